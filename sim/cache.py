"""An engine's prefix cache: whole KV blocks keyed by chained hashes, least recently used
first out.

Assumptions: a block is a hit only if every block before it is (vLLM chains each block's
key to the previous one); the cache holds `capacity` blocks whatever the running
sequences use (vLLM shares one pool between them, so a full engine caches less: not
modelled); a prompt's blocks are refreshed tail first, as vLLM returns a finished
request's blocks to its free queue, so a shared head outlives the tails that hang off it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LruBlocks:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[int]) -> int:
        """How many of the leading blocks are held (the hit stops at the first miss)."""
        n = 0
        for b in blocks:
            if b not in self._blocks:
                break
            n += 1
        return n

    def store(self, blocks: Sequence[int]) -> None:
        """The prompt was prefilled here: its blocks are the most recently used, its head most."""
        held = self._blocks
        for b in reversed(blocks):
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
        while len(held) > self.capacity:
            held.popitem(last=False)
