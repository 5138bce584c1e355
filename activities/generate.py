"""The engine-worker activity: run a group of batch items on vLLM, checkpointing as it goes.

One long activity per group of items, not one per chunk or even per item: each Temporal
dispatch costs tens of milliseconds and control-plane CPU the engine would rather have.
Every `checkpoint_tokens` tokens an item's new tokens go to the journal through the
group-commit checkpointer, without the engine waiting, and the activity heartbeats. A
retried attempt (worker killed, heartbeat lost) resumes each unfinished item from its
journaled tokens by submitting prompt + tokens; with greedy decoding the result is
token-for-token the uninterrupted one. A preempted item flushes every token it has,
records `item_preempted`, and is handed back to the workflow to run again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from activities.batch_input import RequestError
from engine import requests as rq
from engine.slots import EngineSlots
from journal import batches as jb
from journal.checkpointer import Checkpointer
from journal.events import NewEvent
from policy.preemption import TIERS
from workflows.inputs import GenerateResult, ItemGroup

BATCH_PRIORITY = TIERS["batch"]  # vLLM serves lower values first: batch waits behind chat


class GenerationActivities:
    def __init__(self, db: AsyncEngine, engine, checkpointer: Checkpointer, slots: EngineSlots, *,
                 checkpoint_tokens: int = 16):
        self.db = db
        self.engine = engine
        self.checkpointer = checkpointer
        self.slots = slots
        self.checkpoint_tokens = checkpoint_tokens

    @activity.defn
    async def generate(self, group: ItemGroup) -> list[GenerateResult]:
        async with self.db.connect() as conn:
            batch, items = await jb.load_for_generation(conn, group.batch_id, group.idxs)
        progress = {idx: 0 for idx in group.idxs}
        beat = asyncio.create_task(self._heartbeat(progress))
        try:
            async with asyncio.TaskGroup() as tg:  # on cancel: every item flushes, then we return
                tasks = [tg.create_task(self._item(batch, items[idx], progress)) for idx in group.idxs]
        finally:
            beat.cancel()
        return [t.result() for t in tasks]

    async def _item(self, batch: dict[str, Any], item: dict[str, Any], progress: dict[int, int]) -> GenerateResult:
        if item["status"] != "pending":
            return GenerateResult(item["status"], idx=item["idx"])  # a retry after it settled
        batch_id, idx, tenant, endpoint, body = batch["id"], item["idx"], batch["tenant"], batch["endpoint"], item["body"]
        stream = jb.item_stream(batch_id, idx)
        tokens = list(item["tokens"])
        resumed_from = len(tokens)

        prompt = rq.prompt_ids(self.engine, endpoint, body)
        params = rq.sampling(body, len(prompt), self.engine.spec.max_model_len, where=f"Line {item['line']}: ")
        if isinstance(params, RequestError):
            await self.checkpointer.submit([jb.item_failed_event(batch_id, idx, tenant, params.status_code, params.body())])
            return GenerateResult("failed", idx=idx)

        info = activity.info()
        # Who wrote it: this activity attempt, told apart across continue-as-new runs by the
        # run id's random tail (short: it rides on every chunk). Lets an audit check that no
        # two runners ever worked on one item at once.
        runner = f"{info.workflow_run_id[-8:]}:{info.activity_id}:{info.attempt}"

        def chunk(offset: int) -> list[NewEvent]:
            if len(tokens) == offset:
                return []
            payload = dict(batch_id=batch_id, idx=idx, offset=offset, token_ids=tokens[offset:], runner=runner)
            return [NewEvent(stream, "item_chunk", payload, f"{stream}:chunk:{offset}", tenant)]

        saved = len(tokens)  # tokens[:saved] are in the journal (or queued for it)
        reason = None
        if not self._already_finished(tokens, params):
            request_id = f"{stream}:{info.attempt}:{resumed_from}"
            async with self.slots.batch(stream, BATCH_PRIORITY, lambda: self.engine.abort(request_id)) as hold:
                try:
                    async for step in self.engine.generate(
                        request_id, prompt + tokens, max_tokens=params.max_tokens - len(tokens),
                        temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                        stop=params.stop or None, ignore_eos=params.ignore_eos, priority=BATCH_PRIORITY,
                    ):
                        tokens += step.token_ids
                        reason = step.finish_reason
                        hold.generated, hold.unsaved = len(tokens), len(tokens) - saved
                        if hold.preempted.is_set() and reason is None:
                            # Preempted before vLLM had the request, so that abort missed it.
                            await self.engine.abort(request_id)
                        if len(tokens) - saved >= self.checkpoint_tokens and reason is None:
                            self.checkpointer.submit(chunk(saved))
                            saved = progress[idx] = len(tokens)
                except asyncio.CancelledError:
                    # Cancelled (batch cancelled, worker stopping): keep every token we have.
                    await self.engine.abort(request_id)
                    await asyncio.shield(self.checkpointer.submit(chunk(saved)))
                    raise
                if hold.preempted.is_set() and reason in ("abort", None):
                    preempted = NewEvent(stream, "item_preempted", dict(batch_id=batch_id, idx=idx, offset=len(tokens)),
                                         f"{stream}:preempted:{len(tokens)}", tenant)
                    await self.checkpointer.submit([*chunk(saved), preempted])
                    return GenerateResult("preempted", tokens=len(tokens), resumed_from=resumed_from, idx=idx)

        text, reason = rq.finish(self.engine, tokens, params, reason)
        response = rq.response_body(endpoint, jb.stable_id("", stream), body["model"], text, reason,
                                    len(prompt), len(tokens), created=int(time.time()))
        await self.checkpointer.submit([*chunk(saved), jb.item_completed_event(batch_id, idx, tenant, response)])
        return GenerateResult("completed", tokens=len(tokens), resumed_from=resumed_from, idx=idx)

    def _already_finished(self, tokens: list[int], params: rq.Sampling) -> bool:
        """A previous attempt produced everything but died before recording completion."""
        if not tokens:
            return False
        if len(tokens) >= params.max_tokens:
            return True
        if tokens[-1] == self.engine.tokenizer.eos_token_id and not params.ignore_eos:
            return True
        return any(s in self.engine.decode(tokens) for s in params.stop)

    async def _heartbeat(self, progress: dict[int, int]) -> None:
        # Beats even while items wait for a slot or in the engine's queue; three beats per
        # timeout is enough and keeps hundreds of generations cheap.
        timeout = activity.info().heartbeat_timeout
        every = timeout.total_seconds() / 3 if timeout else 5.0
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                activity.heartbeat(sum(progress.values()))
                await asyncio.sleep(every)
