"""The API's placement: a request's prompt hashed into the engine's blocks, ranked by
policy/placement.py against the local engine directory and this process's prefix index,
then remembered where it went. Nothing here calls anything: the directory is refreshed in
the background (api/services/engine_directory.py) and the index is this process's memory.

The prompt is tokenized with its model's own tokenizer files (engine/prompts.py renders it
exactly as the engine worker will), loaded once per model, in the background: the
deployment's own model's from the API's start, another pool's from where its engines say
its files are (a hub id, or a path this host may not have). Until it is loaded, until an
engine worker has built the local tiny model, or where no tokenizer can be loaded,
requests are placed by load alone. The same ids size
the request's quota reservation exactly (api/interactive.py); without them it is estimated
and corrected when the engine reports the prompt's size.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from config import Settings
from engine import embedding, prompts
from policy.placement import EngineView, Request, Weights, rank
from policy.prefix import MAX_BLOCKS, PrefixIndex, block_hashes, root
from protocol.embeddings import EmbeddingRequest
from protocol.requests import CHAT, GenerationRequest

log = logging.getLogger(__name__)
RETRY_LOAD_S = 10.0  # how soon to try loading a tokenizer again after a miss
MAX_BLOCK_SIZE = 128  # the largest block an engine announces (vLLM CPU's)
HEAD_CHARS_PER_TOKEN = 8  # a text prompt's head encoded: ample characters per token


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as token ids; `whole` where they are all of it (so its size is
    exact: what the engine will count), not just the head a giant prompt is cut to."""

    ids: tuple[int, ...] = ()
    whole: bool = False

    @property
    def tokens(self) -> int | None:
        return len(self.ids) if self.whole else None


class Placer:
    def __init__(self, settings: Settings, tokenizer: Any = None):
        self.settings = settings
        affinity = settings.placement_affinity_weight if settings.placement == "affinity" else 0.0
        self.weights = Weights(affinity, settings.placement_load_weight, settings.placement_load_bound)
        self._turn = 0  # round_robin's
        self.index = PrefixIndex(settings.prefix_index_blocks)
        self.own = settings.model_name
        self._tokenizers: dict[str, Any] = {} if tokenizer is None else {self.own: tokenizer}
        self._next_try: dict[str, float] = {}
        self._sources: dict[str, str] = {}  # another pool's model → where its engines load it from
        self._known: frozenset[str] = frozenset()  # the engines seen last time
        # This process's open streams per engine: current, where the engines' own figures
        # are up to a refresh old (a burst placed at once must see itself).
        self.inflight: Counter[str] = Counter()
        self.me = f"api-{uuid.uuid4().hex[:12]}"  # how engines count this process's streams

    @property
    def has_tokenizer(self) -> bool:
        """The deployment's own model's is loaded."""
        return self.own in self._tokenizers

    def tokenizer(self, model: str | None = None) -> Any:
        """`model`'s tokenizer (the deployment's own by default) if loaded; else None, and a
        load started in the background (a second or so): the request path never waits."""
        model = model or self.own
        tok = self._tokenizers.get(model)
        if tok is None and time.monotonic() >= self._next_try.get(model, 0.0):
            self._next_try[model] = time.monotonic() + RETRY_LOAD_S
            threading.Thread(target=self.load, args=(model,), name="placer-tokenizer", daemon=True).start()
        return tok

    def load(self, model: str | None = None) -> Any:
        """Load `model`'s tokenizer now (blocking); None where there is none to load yet."""
        from engine.model_spec import tokenizer_path

        model = model or self.own
        path = tokenizer_path(self.settings) if model == self.own else self._sources.get(model)
        if path is not None and model not in self._tokenizers:
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(path)
                # The first render compiles the chat template (tens of ms): here, not on a request.
                prompts.render_chat(tok, [dict(role="user", content="warm up")])
                self._tokenizers[model] = tok
                # It and what loading it imported live as long as the process: kept out of
                # every full collection's walk, as the rest of the heap at start (ballast/procs.py).
                gc.freeze()
            except Exception as err:  # no files here (an API on another host): place by load
                log.warning("no tokenizer for %s's prefix affinity at %s (%s): placing by load only", model, path, err)
        return self._tokenizers.get(model)

    def prompt(self, req: GenerationRequest | EmbeddingRequest, pool: str | None = None) -> Prompt:
        """The prompt's token ids as the engine of `pool` (the model or its base; the
        deployment's own by default) will feed vLLM; none until its tokenizer is loaded."""
        tok = self.tokenizer(pool)
        if tok is None:
            return Prompt()
        try:
            if isinstance(req, EmbeddingRequest):  # its first input leads, as a prefix would
                ids = embedding.token_ids(tok, replace(req, inputs=req.inputs[:1]))[0]
            elif req.endpoint == CHAT:
                messages, tools = req.chat_inputs()
                ids = prompts.render_chat(tok, messages, tools=tools)
            elif isinstance(req.prompt, tuple):
                ids = list(req.prompt)
            else:
                # A giant text's head is enough for its leading blocks (and it is over any
                # context): no need to encode the tail.
                head = req.prompt[: HEAD_CHARS_PER_TOKEN * MAX_BLOCKS * MAX_BLOCK_SIZE]
                return Prompt(tuple(prompts.render_text(tok, head)), whole=len(head) == len(req.prompt))
        except Exception as err:  # what the template refuses, the engine answers for: placed by load here
            log.debug("no prompt ids for a request: %s", err)
            return Prompt()
        return Prompt(tuple(ids), whole=True)

    def seed(self, req: GenerationRequest | EmbeddingRequest, pool: str | None = None) -> int:
        """The blocks' chain seed: the base model's, or a fine-tuned model's own."""
        return root(None if req.model == (pool or self.own) else req.model)

    def blocks(self, req: GenerationRequest, block_size: int, pool: str | None = None) -> tuple[int, ...]:
        """The prompt's leading blocks, as the engine's prefix cache keys them."""
        return block_hashes(self.prompt(req, pool).ids, block_size, seed=self.seed(req, pool))

    def rank(self, req: GenerationRequest | EmbeddingRequest, engines: list[EngineView],
             regions: frozenset[str] | None = None, prompt: Prompt | None = None,
             pool: str | None = None, tenant: str = "") -> tuple[list[EngineView], tuple[int, ...]]:
        """The engines of `pool` (the deployment's own model by default) to try, best first,
        and the request's blocks (for `sent`); `prompt` where the caller has it already;
        `tenant`'s unused reserved slots first."""
        pool = pool or self.own
        self._forget_gone(engines)
        block_size = next((e.block_size for e in engines if e.model == pool), 16)
        blocks = block_hashes((self.prompt(req, pool) if prompt is None else prompt).ids, block_size,
                              seed=self.seed(req, pool))
        request = Request(pool, blocks, regions, home=self.settings.region, tenant=tenant)
        current = [replace(e, interactive=self.in_flight(e)) for e in engines]
        ranked = rank(current, request, self.index.matched(blocks), self.weights)
        if self.settings.placement == "round_robin" and ranked:
            ranked = sorted(ranked, key=lambda e: e.id)
            self._turn = (self._turn + 1) % len(ranked)
            ranked = ranked[self._turn:] + ranked[:self._turn]
        return ranked, blocks

    def in_flight(self, e: EngineView) -> int:
        """Interactive requests in flight on `e`: this process's own, counted now, plus the
        other API processes' as of its last report. (Its own `interactive` figure is a peak
        over the last few reports, for the fleet controller: placing by it would herd every
        request away from an engine for seconds after a short burst there.)"""
        if e.others is None:  # an engine worker that does not count by API process
            return max(e.interactive, self.inflight[e.id])
        return self.inflight[e.id] + e.others

    def engines_seen(self, engines: list[EngineView]) -> None:
        """The directory has refreshed: once an engine serves (and so, on this host, has
        built the model's files), its model's tokenizer loads, off any request's path."""
        for e in engines:
            if e.model != self.own and e.source:
                self._sources.setdefault(e.model, e.source)
        for model in sorted({e.model for e in engines}):
            self.tokenizer(model)

    def sent(self, engine: EngineView, blocks: tuple[int, ...], seqs: int = 1) -> None:
        """The request went to `engine`: it holds the blocks now, and one more stream of
        `seqs` sequences (its `n`), as the engine counts its interactive load."""
        self.index.record(engine.id, blocks)
        self.inflight[engine.id] += seqs

    def done(self, engine_id: str, seqs: int = 1) -> None:
        """A stream `sent` there has ended, however."""
        if self.inflight[engine_id] > seqs:
            self.inflight[engine_id] -= seqs
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
