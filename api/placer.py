"""The API's placement: a request's prompt hashed into the engine's blocks, ranked by
policy/placement.py against the local engine directory and this process's prefix index,
then remembered where it went. Nothing here calls anything: the directory is refreshed in
the background (api/engines.py) and the index is this process's memory.

The prompt is tokenized with the served model's own tokenizer files (engine/prompts.py
renders it exactly as the engine worker will), loaded once, in the background from the
API's start: until it is loaded, until an engine worker has built the local tiny model, or
where no tokenizer can be loaded, requests are placed by load alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from ballast.settings import Settings
from engine import prompts
from policy.placement import EngineView, Request, Weights, rank
from policy.prefix import MAX_BLOCKS, PrefixIndex, block_hashes
from protocol.requests import CHAT, GenerationRequest

log = logging.getLogger(__name__)
RETRY_LOAD_S = 10.0  # how soon to try loading a tokenizer again after a miss


class Placer:
    def __init__(self, settings: Settings, tokenizer: Any = None):
        self.settings = settings
        affinity = settings.placement_affinity_weight if settings.placement == "affinity" else 0.0
        self.weights = Weights(affinity, settings.placement_load_weight, settings.placement_load_bound)
        self._turn = 0  # round_robin's
        self.index = PrefixIndex(settings.prefix_index_blocks)
        self._tokenizer = tokenizer
        self._next_try = 0.0
        self._known: frozenset[str] = frozenset()  # the engines seen last time
        # This process's open streams per engine: current, where the engines' own figures
        # are up to a refresh old (a burst placed at once must see itself).
        self.inflight: Counter[str] = Counter()

    def tokenizer(self) -> Any:
        """The tokenizer if loaded; else None, and a load started in the background (a
        second or so): the request path never waits for it."""
        if self._tokenizer is None and time.monotonic() >= self._next_try:
            self._next_try = time.monotonic() + RETRY_LOAD_S
            threading.Thread(target=self.load, name="placer-tokenizer", daemon=True).start()
        return self._tokenizer

    def load(self) -> Any:
        """Load the tokenizer now (blocking); None where there is none to load yet."""
        from engine.models import tokenizer_path

        path = tokenizer_path(self.settings)
        if path is not None and self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(path)
                # The first render compiles the chat template (tens of ms): here, not on a request.
                prompts.render_chat(tok, [dict(role="user", content="warm up")])
                self._tokenizer = tok
            except Exception as err:  # no files here (an API on another host): place by load
                log.warning("no tokenizer for prefix affinity at %s (%s): placing by load only", path, err)
        return self._tokenizer

    def blocks(self, req: GenerationRequest, block_size: int) -> tuple[int, ...]:
        """The prompt's leading blocks, as the engine's prefix cache keys them."""
        tok = self.tokenizer()
        if tok is None:
            return ()
        try:
            if req.endpoint == CHAT:
                ids = prompts.render_chat(tok, [dict(role=m.role, content=m.content) for m in req.messages])
            elif isinstance(req.prompt, tuple):
                ids = list(req.prompt)
            else:
                # Only the leading blocks count: no need to encode a giant prompt's tail.
                ids = prompts.render_text(tok, req.prompt[: 8 * MAX_BLOCKS * block_size])
        except Exception as err:  # what the template refuses, the engine answers for: placed by load here
            log.debug("no prefix blocks for a request: %s", err)
            return ()
        return block_hashes(ids, block_size)

    def rank(self, req: GenerationRequest, engines: list[EngineView],
             regions: frozenset[str] | None = None) -> tuple[list[EngineView], tuple[int, ...]]:
        """The engines to try, best first, and the request's blocks (for `sent`)."""
        self._forget_gone(engines)
        block_size = next((e.block_size for e in engines if e.model == self.settings.model_name), 16)
        blocks = self.blocks(req, block_size)
        request = Request(self.settings.model_name, blocks, regions)
        current = [replace(e, interactive=max(e.interactive, self.inflight[e.id])) if self.inflight[e.id] else e
                   for e in engines]
        ranked = rank(current, request, self.index.matched(blocks), self.weights)
        if self.settings.placement == "round_robin" and ranked:
            ranked = sorted(ranked, key=lambda e: e.id)
            self._turn = (self._turn + 1) % len(ranked)
            ranked = ranked[self._turn:] + ranked[:self._turn]
        return ranked, blocks

    def sent(self, engine: EngineView, blocks: tuple[int, ...]) -> None:
        """The request went to `engine`: it holds the blocks now, and one more stream."""
        self.index.record(engine.id, blocks)
        self.inflight[engine.id] += 1

    def done(self, engine_id: str) -> None:
        """A stream `sent` there has ended, however."""
        if self.inflight[engine_id] > 1:
            self.inflight[engine_id] -= 1
        else:
            del self.inflight[engine_id]

    def _forget_gone(self, engines: list[EngineView]) -> None:
        """An engine that left the pool holds nothing: only its prefixes move elsewhere."""
        now = frozenset(e.id for e in engines)
        if now != self._known:
            for gone in self._known - now:
                log.info("engine %s left: %d prefix blocks forgotten", gone, self.index.forget(gone))
                self.inflight.pop(gone, None)
            self._known = now
