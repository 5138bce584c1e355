"""Batch prompts that share a prefix with one being prefilled wait for it: the shell
around `policy.prefix.follows`.

A leader (a batch generation whose prompt shares no long prefix with anything in flight)
registers its prompt's leading blocks while vLLM prefills it; a follower waits, before
it takes a batch slot, until the leader's first token (its prompt's blocks are in vLLM's
cache then), the leader's end, or `patience_s`, whichever comes first, and then finds the
shared blocks cached. A prefix-heavy batch (a few long system prompts or few-shot
examples shared by thousands of lines) then prefills each prefix about once, not once
per line that happened to arrive beside another.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence

from policy.prefix import follows


class PrefixLeaders:
    def __init__(self, patience_s: float = 10.0, *, min_share: float = 0.5, min_blocks: int = 0):
        self.min_share = min_share
        self.min_blocks = min_blocks  # a step's prefill, in blocks (policy.prefix.follows)
        self.patience_s = patience_s
        self._prefilling: dict[int, asyncio.Event] = {}  # leading block → its leader's "prefilled"
        self.followed = 0  # prompts that waited on a leader

    async def wait(self, blocks: Sequence[int]) -> None:
        """Wait on the leader of the longest prefix `blocks` shares, if any (see above)."""
        block = follows(blocks, self._prefilling, self.min_share, self.min_blocks) if self.patience_s > 0 else None
        if block is None:
            return
        self.followed += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._prefilling[block].wait(), self.patience_s)

    @contextlib.contextmanager
    def lead(self, blocks: Sequence[int]) -> Iterator[Callable[[], None]]:
        """Register `blocks` as being prefilled for the block; call what it yields once the
        prompt's first token is out (its followers go then), as leaving the block does.
        Blocks another leader holds stay its."""
        event = asyncio.Event()
        mine = [b for b in blocks if b not in self._prefilling] if self.patience_s > 0 else []
        for b in mine:
            self._prefilling[b] = event

        def prefilled() -> None:
            if event.is_set():
                return
            event.set()
            for b in mine:
                if self._prefilling.get(b) is event:
                    del self._prefilling[b]

        try:
            yield prefilled
        finally:
            prefilled()
