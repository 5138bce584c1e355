"""The engine-worker activity: run a group of batch items on vLLM, checkpointing as it goes.

One long activity per group of items, not one per chunk or even per item: each Temporal
dispatch costs tens of milliseconds and control-plane CPU the engine would rather have.
The token loop only collects: the checkpointer (journal/checkpointer.py) takes every
item's new tokens at each of its commits, one multi-row append per engine per tick (or
sooner, once an item has `checkpoint_tokens` unsaved), and the activity heartbeats what
is journaled. A retried attempt (worker killed, heartbeat lost) resumes each unfinished
item from its journaled tokens by submitting prompt + tokens; with greedy decoding the
result is token-for-token the uninterrupted one. A preempted item flushes every token it
has, records `item_preempted`, and waits on this engine for a slot again: the resume
costs one prefill (mostly prefix-cache hits), not a Temporal round trip and a reload.

Items are isolated: one that fails for any reason of its own ends in the error file with
its own status and message and never fails, retries or delays the others. Attempts are
fenced: each attempt takes the item's lease first, and the database refuses any append
that carries an older attempt's token, so a zombie attempt (its heartbeat lost, still
running) cannot write once its retry has begun.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import beating
from engine import embedding, sampling
from engine.prefix_leaders import PrefixLeaders
from engine.slots import EngineSlots
from engine.trace import OFF, Trace
from journal import batch_store
from journal.checkpointer import Checkpointer
from journal.events import NewEvent, StaleAttempt
from journal.leases import acquire_many
from policy.prefix import block_hashes, root
from protocol import embeddings, keys, responses
from protocol.errors import ProtocolError, storable
from protocol.events import EventType, ItemChunk, ItemPreempted, choice_key, chunk_payload, preempted_payload
from protocol.requests import EMBEDDINGS, RequestLimits, parse
from protocol.temporal import GenerateInput, GenerateResult
from protocol.tiers import RANK, Tier
from telemetry import families

log = logging.getLogger(__name__)

BATCH_PRIORITY = RANK[Tier.BATCH]  # vLLM serves lower values first: batch waits behind chat
ITEM_TRIES = 3  # an item the engine keeps failing is failed alone after this many tries
PREEMPTED = "preempted"  # _on_engine's word for "yielded, every token journaled"


class GenerationActivities:
    def __init__(self, db: AsyncEngine, engine, checkpointer: Checkpointer, slots: EngineSlots, *,
                 checkpoint_tokens: int = 256, retry_delay_s: float = 1.0, trace: Trace = OFF,
                 leaders: PrefixLeaders | None = None):
        self.db = db
        self.engine = engine
        self.checkpointer = checkpointer
        self.slots = slots
        self.leaders = leaders or PrefixLeaders()
        self.checkpoint_tokens = checkpoint_tokens
        self.retry_delay_s = retry_delay_s
        self.trace = trace

    @activity.defn
    async def generate(self, group: GenerateInput) -> list[GenerateResult]:
        info = activity.info()
        # Who writes: this activity attempt, told apart across continue-as-new runs by the
        # run id's random tail (short: it rides on every chunk).
        runner = f"{(info.workflow_run_id or '')[-8:]}:{info.activity_id}:{info.attempt}"
        # Leases first, then what is journaled: whatever an older attempt wrote before we
        # took the lease is read below, and nothing it writes after can land.
        async with self.db.begin() as conn:
            taken = await acquire_many(conn, [keys.item(group.batch_id, idx) for idx in group.idxs], runner)
        fences = {idx: taken[keys.item(group.batch_id, idx)] for idx in group.idxs}
        async with self.db.connect() as conn:
            batch, items = await batch_store.load_for_generation(conn, group.batch_id, group.idxs)
        if foreign := self._foreign(items.values()):
            # Only from the queue every pool shared before each had its own: another
            # pool's engine takes it on a retry. Nothing was written.
            raise ApplicationError(f"batch {group.batch_id} runs {foreign!r}, which this engine worker "
                                   f"({self.engine.spec.name!r}) does not serve", type="ForeignModel")
        self.trace("activity", group=info.activity_id, items=len(group.idxs))
        progress: dict[str, int] = {}
        running = set(group.idxs)
        beat = asyncio.create_task(beating(lambda: sum(progress.values())))
        try:
            async with asyncio.TaskGroup() as tg:  # on cancel: every item flushes, then we return
                tasks = [tg.create_task(self._isolated(Attempt(batch, items[idx], runner, fences[idx], progress,
                                                               running=running)))
                         for idx in group.idxs]
        finally:
            beat.cancel()
        return [t.result() for t in tasks]

    def _foreign(self, items) -> str | None:
        """The model a pending item names that this engine's pool does not serve, if any."""
        own = self.engine.spec.name
        for item in items:
            model = item["body"].get("model") if item["status"] == "pending" else None
            if isinstance(model, str) and model != own and not model.startswith(keys.fine_tuned_prefix(own)):
                return model
        return None

    async def _isolated(self, at: Attempt) -> GenerateResult:
        """Run one item; whatever goes wrong with it stays with it."""
        try:
            return await self._tries(at)
        finally:
            if at.idx in at.running:  # it ended with no result of its own (superseded, settled before)
                self._ended(at)

    async def _result(self, at: Attempt, events: list[NewEvent]) -> None:
        """Journal an item's result: at the checkpointer's next tick, or right away where
        it is the last of its activity's items to end, as the activity's end (and the
        batch's next group, or its finalization) would otherwise wait up to a tick for it."""
        commit = self.checkpointer.submit(events)
        self._ended(at)
        await commit

    def _ended(self, at: Attempt) -> None:
        at.running.discard(at.idx)
        if not at.running:  # the last: commit what its activity waits on now
            self.checkpointer.soon()

    async def _tries(self, at: Attempt) -> GenerateResult:
        for tries in range(1, ITEM_TRIES + 1):
            at.tries = tries
            try:
                return await self._item(at)
            except StaleAttempt:
                # A newer attempt holds the item: it owns the result, we write nothing more.
                log.info("%s: superseded by a newer attempt", at.stream)
                return GenerateResult("superseded", idx=at.idx)
            except DBAPIError:
                raise  # the journal itself is unwell: the whole attempt retries, nothing is lost
            except Exception as err:
                failure = _failure(err)
                log.warning("%s: try %d failed: %s", at.stream, tries, failure.message)
                if failure.status_code < 500 or tries == ITEM_TRIES:
                    await self._result(at, [at.failed(failure)])
                    self._count(at, "failed")
                    return GenerateResult("failed", idx=at.idx)
                await asyncio.sleep(self.retry_delay_s * tries)
                async with self.db.connect() as conn:  # resume from what is journaled now
                    _, reloaded = await batch_store.load_for_generation(conn, at.batch["id"], [at.idx])
                at.item = reloaded[at.idx]
        raise AssertionError("unreachable")

    async def _item(self, at: Attempt) -> GenerateResult:
        item, idx, endpoint = at.item, at.idx, at.batch["endpoint"]
        if item["status"] != "pending":
            return GenerateResult(item["status"], idx=idx)  # a retry after it settled
        spec = self.engine.spec
        if (wrong := embeddings.wrong_task(spec.name, spec.embeds, endpoint)) is not None:
            await self._result(at, [at.failed(wrong.at_line(item["line"]))])
            self._count(at, "failed")
            return GenerateResult("failed", idx=idx)
        if endpoint == EMBEDDINGS:
            return await self._embed(at)
        req = parse(endpoint, item["body"], RequestLimits(self.engine.spec.name, self.engine.spec.max_model_len,
                                                   any_adapter=True), batch=True)
        ready = req if isinstance(req, ProtocolError) else sampling.prepare(self.engine, req)
        if isinstance(ready, ProtocolError):
            await self._result(at, [at.failed(ready.at_line(item["line"]))])
            self._count(at, "failed")
            return GenerateResult("failed", idx=idx)
        assert not isinstance(req, ProtocolError)  # else `ready` is that error
        prompt, params, calls = ready.prompt, ready.sampling, ready.calls
        # An echo's prompt logprobs come from one request over the prompt alone, at the end:
        # each run of the item would otherwise compute them over its prompt and tokens anew.
        echo_logprobs, params = params.prompt_logprobs, replace(params, prompt_logprobs=None)
        # Each choice is a generation of its own, resumed from what it journaled.
        runs = [at] + [at.choice(c) for c in range(1, req.n)]
        for run in runs:
            run.resume(*item["choices"].get(run.index, ([], [])))
        resumed_from = sum(run.saved for run in runs)
        reasons = await _all([self._choice(run, prompt, sampling.choice(params, run.index)) for run in runs])
        echoed = None
        if req.echo and echo_logprobs is not None:  # the same prompt for every choice
            echoed = await self._prompt_logprobs(at, prompt, replace(params, prompt_logprobs=echo_logprobs))
        choices, used = [], 0
        for run, reason in zip(runs, reasons, strict=True):
            text, reason, count = sampling.finish(self.engine, prompt, run.tokens, params, reason)
            content: str | None = text
            tool_calls = None
            if calls is not None:  # read from all its tokens' text, however many runs made them
                message = calls.whole(text, reason)
                content, tool_calls, reason = message.content, message.tool_calls, message.finish_reason
            if req.echo:  # completions only: no tool calls
                content = sampling.echo_text(self.engine, req, prompt) + (text if req.max_tokens != 0 else "")
            choices.append(responses.Choice(content, reason, sampling.logprobs(
                self.engine, req, run.tokens[:count], run.logprobs[:count], echoed), tool_calls))
            used += count
        kind = "chatcmpl" if req.endpoint == sampling.CHAT else "cmpl"
        meta = dict(id=f"{kind}-{batch_store.stable_id('', at.stream)}", created=int(time.time()), model=req.model)
        body = responses.completion(endpoint, meta, choices, len(prompt), used, cached_tokens=at.cached)
        await self._result(at, [*(e for run in runs for e in run.due()), at.completed(body)])
        tokens = sum(len(run.tokens) for run in runs)
        self._count(at, "completed", tokens - resumed_from)
        return GenerateResult("completed", tokens=tokens, resumed_from=resumed_from, idx=idx)

    async def _embed(self, at: Attempt) -> GenerateResult:
        """An item of embeddings: one pass, whole. A surge does not cut it short (there is
        nothing to keep of half a pass); it holds a batch slot, so the items after it wait
        for one, and a retried attempt embeds it anew."""
        req = embeddings.parse(at.item["body"], RequestLimits(self.engine.spec.name, self.engine.spec.max_model_len))
        ids = req if isinstance(req, ProtocolError) else embedding.inputs(self.engine, req)
        if isinstance(ids, ProtocolError):
            await self._result(at, [at.failed(ids.at_line(at.item["line"]))])
            self._count(at, "failed")
            return GenerateResult("failed", idx=at.idx)
        assert not isinstance(req, ProtocolError)  # else `ids` is that error

        async def whole() -> None:  # a preemption's abort: the pass ends on its own within a step
            pass

        async with self.slots.batch(at.key, BATCH_PRIORITY, whole, at.deadline, at.tenant):
            vectors = await self.engine.embed(f"{at.key}:{at.fence}:{at.tries}", ids, dimensions=req.dimensions,
                                              priority=BATCH_PRIORITY)
        await self._result(at, [at.completed(embeddings.response(req.model, vectors, sum(map(len, ids)),
                                                                 req.base64))])
        self._count(at, "completed")
        return GenerateResult("completed", idx=at.idx)

    async def _choice(self, run: Attempt, prompt: list[int], params: sampling.Sampling) -> str | None:
        """One choice to its end: its finish reason (None: it had finished before)."""
        while not self._already_finished(prompt, run.tokens, params):
            got = await self._on_engine(run, prompt, params)
            if got != PREEMPTED:
                return got
            # Yielded, its tokens journaled with the preemption: it waits here for a slot
            # (the cap lifts after the cool-down) and goes on from them, with no round trip
            # through the workflow and no reload, while the engine serves the chat.
        return None

    async def _prompt_logprobs(self, at: Attempt, prompt: list[int], params: sampling.Sampling) -> list[Any]:
        """An echo's prompt logprobs, under a batch slot like any run of the item."""
        request_id = f"{at.stream}:{at.fence}:{at.tries}:echo"
        async with self.slots.batch(at.stream, BATCH_PRIORITY, lambda: self.engine.abort(request_id), at.deadline,
                                    at.tenant):
            return await sampling.prompt_logprobs(self.engine, request_id, prompt, params)

    def _count(self, at: Attempt, outcome: str, tokens: int = 0) -> None:
        """The item's outcome here, journaled, in this worker's metrics (telemetry/families.py)."""
        tenant, model = families.tenant(at.batch["tenant"]), self.engine.spec.name
        families.BATCH_ITEMS.labels(tenant, model, outcome).inc()
        if tokens:
            families.BATCH_TOKENS.labels(tenant, model).inc(tokens)

    async def _on_engine(self, at: Attempt, prompt: list[int], params: sampling.Sampling) -> str | None:
        """One stretch of the item on vLLM, under a batch slot: its finish reason, or
        PREEMPTED once every token it has is journaled."""
        tokens, reason = at.tokens, None
        if tokens or at.runs:  # a resumption: its prompt and tokens are prefilled again
            families.REPREFILLED.labels(self.engine.spec.name).inc(len(prompt) + len(tokens))
        at.runs += 1  # a preemption before any new token resumes at the same offset: ids stay unique
        request_id = f"{at.key}:{at.fence}:{at.tries}:{at.saved}:{at.runs}"
        rest = sampling.resumed(params, tokens)
        blocks = block_hashes(prompt + tokens, self.engine.block_size, seed=root(params.adapter))
        first, resuming = True, bool(tokens)
        await self.leaders.wait(blocks)
        async with self.slots.batch(at.key, BATCH_PRIORITY, lambda: self.engine.abort(request_id),
                                    at.deadline, at.tenant) as hold:
            self.trace("submit", item=at.key)
            try:
                with self.checkpointer.track(at), self.leaders.lead(blocks) as prefilled:
                    async for step in self.engine.generate(
                        request_id, prompt + tokens, rest, resumed=len(tokens),
                        priority=BATCH_PRIORITY, item=at.key, resumed_from=at.saved,  # for engine/gate.py
                    ):
                        if first:
                            first = False
                            prefilled()
                            if resuming:  # what re-prefilling cost prices the next wait (engine/slots.py)
                                self.slots.resumed(hold)
                        if at.cached is None:  # the prompt's, as the first stretch found it
                            at.cached = min(step.cached_tokens, len(prompt))
                        tokens += step.token_ids
                        if step.logprobs is not None:
                            at.logprobs += step.logprobs
                        reason = step.finish_reason
                        hold.generated, hold.unsaved = len(tokens), len(tokens) - at.saved
                        if hold.unsaved >= self.checkpoint_tokens:
                            self.checkpointer.soon()
                        if hold.preempted.is_set() and reason is None:
                            # Preempted before vLLM had the request, so that abort missed it.
                            await self.engine.abort(request_id)
                        at.raise_if_refused()  # a newer attempt took over: stop now, not at the end
                self.trace("finish", item=at.key, tokens=len(tokens))
            except asyncio.CancelledError:
                # Cancelled (batch cancelled, worker stopping): keep every token we have.
                await self.engine.abort(request_id)
                await asyncio.shield(self.checkpointer.submit(at.due(), urgent=True))
                raise
            except BaseException:
                await self.engine.abort(request_id)
                raise
        if hold.preempted.is_set() and reason in ("abort", None):
            await self.checkpointer.submit([*at.due(), at.preempted(len(tokens))], urgent=True)
            self._count(at, PREEMPTED)
            return PREEMPTED
        return reason

    def _already_finished(self, prompt: list[int], tokens: list[int], params: sampling.Sampling) -> bool:
        """A previous attempt produced everything but died before recording completion."""
        if not tokens:
            return False
        if len(tokens) >= params.max_tokens:
            return True
        if params.stop_token(self.engine, tokens[-1]):
            return True
        return sampling.stopped(self.engine, prompt, tokens, params)


async def _all(runs: list[Any]) -> list[Any]:
    """Each coroutine's result; the first to fail cancels the rest (each flushes what it
    has) and its error is raised as itself, not in a group."""
    if len(runs) == 1:
        return [await runs[0]]
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(run) for run in runs]
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


class Attempt:
    """One item (one of its choices) under this attempt's lease: every event it writes
    carries the fence."""

    def __init__(self, batch: dict[str, Any], item: dict[str, Any], runner: str, fence: int,
                 progress: dict[str, int] | None = None, index: int = 0, *, running: set[int] | None = None):
        self.batch, self.item, self.runner, self.fence = batch, item, runner, fence
        self.idx: int = item["idx"]
        self.index = index  # the choice
        self.stream = keys.item(batch["id"], self.idx)
        self.key = self.stream if index == 0 else f"{self.stream}#{index}"  # its requests and slot holds
        self.tries = 1
        self.runs = 0  # stretches on the engine (one more after each preemption)
        self.tokens: list[int] = []  # every token the item has, journaled or not
        self.logprobs: list[Any] = []  # each token's alternatives, where the request asked for them
        self.saved = 0  # tokens[:saved] are journaled, or in a commit on its way
        self.cached: int | None = None  # prompt tokens the engine had cached (usage.prompt_tokens_details)
        self.progress = progress if progress is not None else {}  # heartbeat details, by key
        # The items of its activity still running (this one until it has its result).
        self.running = running if running is not None else {self.idx}
        self._refused: BaseException | None = None
        # Its batch's completion window ends: engine slots go earliest deadline first, and
        # work not due soon by tenant in turn.
        self.deadline: float | None = float(batch["expires_at"]) if batch.get("expires_at") else None
        self.tenant: str = batch.get("tenant", "")

    def choice(self, index: int) -> Attempt:
        """Another of the item's choices, under the same lease."""
        other = Attempt(self.batch, self.item, self.runner, self.fence, self.progress, index, running=self.running)
        other.tries = self.tries
        return other

    def resume(self, journaled: list[int], logprobs: list[Any] | None = None) -> None:
        self.tokens, self.saved = list(journaled), len(journaled)
        self.logprobs = list(logprobs or [])
        if self.logprobs and len(self.logprobs) != self.saved:
            raise AssertionError(f"{self.key}: {self.saved} tokens journaled with {len(self.logprobs)} logprobs")
        self.progress[self.key] = self.saved

    def due(self) -> list[NewEvent]:
        """The tokens since the last checkpoint, as one chunk event (the checkpointer's
        `Tracked`, and the flush before a result or a yield)."""
        offset, self.saved = self.saved, len(self.tokens)
        if self.saved == offset:
            return []
        self.progress[self.key] = self.saved
        chunk = ItemChunk(self.batch["id"], self.idx, offset, self.tokens[offset:], self.runner,
                          self.logprobs[offset:self.saved] if self.logprobs else None, self.index)
        return [NewEvent(self.stream, EventType.ITEM_CHUNK, chunk_payload(chunk),
                         choice_key(self.stream, "chunk", self.index, offset), self.batch["tenant"], fence=self.fence)]

    def committed(self, commit: asyncio.Future) -> None:
        """A checkpoint nobody awaits: remember if the journal refused it."""

        def seen(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                self._refused = f.exception()

        commit.add_done_callback(seen)

    def raise_if_refused(self) -> None:
        if isinstance(self._refused, StaleAttempt):
            raise self._refused

    def preempted(self, offset: int) -> NewEvent:
        yielded = ItemPreempted(self.batch["id"], self.idx, offset, self.index)
        return NewEvent(self.stream, EventType.ITEM_PREEMPTED, preempted_payload(yielded),
                        choice_key(self.stream, "preempted", self.index, offset), self.batch["tenant"],
                        fence=self.fence)

    def completed(self, body: dict[str, Any]) -> NewEvent:
        return batch_store.item_completed_event(self.batch["id"], self.idx, self.batch["tenant"], body,
                                                fence=self.fence)

    def failed(self, err: ProtocolError) -> NewEvent:
        return batch_store.item_failed_event(self.batch["id"], self.idx, self.batch["tenant"], err.status_code,
                                             err.body(),
                                             fence=self.fence)


def _failure(err: Exception) -> ProtocolError:
    """What the error file says of an item the engine could not run."""
    if isinstance(err, ValueError):  # vLLM refuses what it cannot serve with a ValueError
        return ProtocolError(400, "invalid_request", storable(f"The engine refused the request: {err}"))
    return ProtocolError(500, "engine_error",
                         storable(f"The engine failed on this request: {type(err).__name__}: {err}"))
