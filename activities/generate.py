"""The engine-worker activity: run one batch item on vLLM, checkpointing as it goes.

One long activity per item (not one per chunk: each Temporal dispatch costs tens of ms).
Every `checkpoint_tokens` tokens the new tokens go to the journal through the group-commit
checkpointer, without the engine waiting, and the activity heartbeats its offset. A retried
attempt (worker killed, heartbeat lost) resumes from the journaled tokens by submitting
prompt + tokens; with greedy decoding the result is token-for-token the uninterrupted one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.batch_input import RequestError
from engine import requests as rq
from journal import batches as jb
from journal.checkpointer import Checkpointer
from journal.events import NewEvent, read_stream
from workflows.inputs import GenerateResult, ItemRef

# vLLM serves lower values first; interactive traffic uses 0, batch work waits behind it.
BATCH_PRIORITY = 10


class GenerationActivities:
    def __init__(self, db: AsyncEngine, engine, checkpointer: Checkpointer, *, checkpoint_tokens: int = 16):
        self.db = db
        self.engine = engine
        self.checkpointer = checkpointer
        self.checkpoint_tokens = checkpoint_tokens

    @activity.defn
    async def generate(self, ref: ItemRef) -> GenerateResult:
        stream = jb.item_stream(ref.batch_id, ref.idx)
        async with self.db.connect() as conn:
            item = await jb.get_item(conn, ref.batch_id, ref.idx)
            if item is None:
                raise ApplicationError(f"no item {stream}", non_retryable=True)
            if item["status"] != "pending":
                return GenerateResult(item["status"])  # a retry after it settled
            batch = await jb.get_batch(conn, ref.batch_id)
            tokens = journaled_tokens(await read_stream(conn, stream, type="item_chunk"))
        tenant, endpoint, body = batch["tenant"], batch["endpoint"], item["body"]
        resumed_from = len(tokens)

        prompt = rq.prompt_ids(self.engine, endpoint, body)
        params = rq.sampling(body, len(prompt), self.engine.spec.max_model_len, where=f"Line {item['line']}: ")
        if isinstance(params, RequestError):
            await self._settle(jb.item_failed_event(ref.batch_id, ref.idx, tenant, params.status_code, params.body()))
            return GenerateResult("failed")

        def chunk(offset: int, ids: list[int]) -> NewEvent:
            payload = dict(batch_id=ref.batch_id, idx=ref.idx, offset=offset, token_ids=ids)
            return NewEvent(stream, "item_chunk", payload, f"{stream}:chunk:{offset}", tenant)

        saved = len(tokens)  # tokens[:saved] are in the journal (or queued for it)
        reason = None
        if not self._already_finished(tokens, params):
            request_id = f"{stream}:{activity.info().attempt}"
            beat = asyncio.create_task(self._heartbeat(lambda: saved))
            try:
                async for step in self.engine.generate(
                    request_id, prompt + tokens, max_tokens=params.max_tokens - len(tokens),
                    temperature=params.temperature, top_p=params.top_p, seed=params.seed, stop=params.stop or None,
                    ignore_eos=params.ignore_eos, priority=BATCH_PRIORITY,
                ):
                    tokens += step.token_ids
                    reason = step.finish_reason
                    if len(tokens) - saved >= self.checkpoint_tokens and reason is None:
                        self.checkpointer.submit([chunk(saved, tokens[saved:])])
                        saved = len(tokens)
            except asyncio.CancelledError:
                # Cancelled (batch cancel, preemption): keep every token we have, then stop.
                await self.engine.abort(request_id)
                if len(tokens) > saved:
                    await asyncio.shield(self.checkpointer.submit([chunk(saved, tokens[saved:])]))
                raise
            finally:
                beat.cancel()

        text, reason = rq.finish(self.engine, tokens, params, reason)
        response = rq.response_body(endpoint, jb.stable_id("", stream), body["model"], text, reason,
                                    len(prompt), len(tokens), created=int(time.time()))
        done = jb.item_completed_event(ref.batch_id, ref.idx, tenant, response)
        await self._settle(*([chunk(saved, tokens[saved:])] if len(tokens) > saved else []), done)
        return GenerateResult("completed", tokens=len(tokens), resumed_from=resumed_from)

    async def _settle(self, *events: NewEvent) -> None:
        await self.checkpointer.submit(events)

    def _already_finished(self, tokens: list[int], params: rq.Sampling) -> bool:
        """A previous attempt produced everything but died before recording completion."""
        if not tokens:
            return False
        if len(tokens) >= params.max_tokens:
            return True
        if tokens[-1] == self.engine.tokenizer.eos_token_id and not params.ignore_eos:
            return True
        return any(s in self.engine.decode(tokens) for s in params.stop)

    async def _heartbeat(self, offset) -> None:
        # Beats even while the request waits in the engine's queue and produces nothing.
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                activity.heartbeat(offset())
                await asyncio.sleep(1.0)


def journaled_tokens(chunks) -> list[int]:
    """The contiguous run of checkpointed tokens from offset 0."""
    tokens: list[int] = []
    for ev in sorted(chunks, key=lambda e: e.payload["offset"]):
        if ev.payload["offset"] != len(tokens):
            break  # a gap (a commit that failed); what follows is regenerated
        tokens += ev.payload["token_ids"]
    return tokens
