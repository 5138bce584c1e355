"""Control-worker activities of a batch: validate, page items, move status, write results.

Every one is idempotent: its journal appends carry keys derived from the batch and item,
and the files it writes are replaced whole under ids derived the same way.

Quota: validation estimates the batch's tokens (each item's input estimate + max_tokens,
`policy.admission.estimate`) and, if the tenant's open batches plus this one would pass
its `batch_queue_tokens` limit, fails the batch with `token_limit_exceeded`; else it
reserves them in the ledger (`batch:<id>`) in the transaction that puts the batch in
progress. In that transaction too, its completion window is promised, or the batch fails
with `completion_window_unattainable` (policy/promises.py) and nothing of it is kept.
Items are never refused for capacity: they wait. Each item settles as its result is
journaled (journal/projections.py); the batch's end refunds the reservation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from sqlalchemy.exc import DataError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.exceptions import ApplicationError

from journal import batch_store, engine_registry, finetune_store, ledger, promises
from journal.leases import acquire
from policy.admission import Refuse, admit_batch, describe_batch, estimate, estimate_embedding
from policy.grouping import assign, own_queue
from policy.lifecycle import finalize_plan
from policy.placement import region_queue
from policy.promises import Unattainable, describe
from protocol import batch as batch_file
from protocol import keys
from protocol.embeddings import EmbeddingRequest
from protocol.engine_wire import EngineStats
from protocol.errors import ProtocolError, storable
from protocol.events import ItemFailed, item_result
from protocol.limits import ANY_MODEL
from protocol.requests import RequestLimits
from protocol.temporal import (
    FailBatchInput,
    FailItemInput,
    FinalizeInput,
    Page,
    PendingInput,
    ValidateInput,
    ValidateResult,
)
from protocol.tiers import Tier
from storage.objects import ObjectStore

PREFIX_KEY_CHARS = 4096  # of each prompt, to find the runs that share a prefix by
MiB = 1 << 20
LIVE_S = 10.0  # an engine worker that has not announced itself for this long gets no group


class BatchActivities:
    def __init__(self, db: AsyncEngine, store: ObjectStore, limits: RequestLimits, max_lines: int,
                 windows: dict[str, int] | None = None, promise_share: float = 0.8):
        self.db = db
        self.store = store
        self.limits = limits
        self.max_lines = max_lines
        self.windows = windows or {"24h": 86_400}  # the completion windows offered
        self.promise_share = promise_share

    @activity.defn
    async def validate_batch(self, ref: ValidateInput) -> ValidateResult:
        async with self.db.connect() as conn:
            batch = await batch_store.get_batch(conn, ref.batch_id)
            assert batch is not None, f"batch {ref.batch_id} vanished"
            counts = await batch_store.request_counts(conn, ref.batch_id)
            if counts["total"] or batch["status"] == "failed":  # a retry after we already decided
                return ValidateResult(counts["total"], batch["status"] == "failed")
            file = await batch_store.get_file(conn, batch["input_file_id"], batch["tenant"])
            # Items may name the tenant's own fine-tuned models, as its chats may.
            own = replace(await self._pool_limits(conn, ref.model),
                          adapters=frozenset(await finetune_store.fine_tuned_models(conn, batch["tenant"])))
        if file is None:  # the API saw it when it created the batch: only lost data gets here
            raise ApplicationError(f"The input file {batch['input_file_id']} is missing.", non_retryable=True)
        limits = batch_file.FileLimits(batch["endpoint"], own, self.max_lines)
        # Two passes over the stored file, never all of it in memory: is it usable at
        # all, then its items, in pages, in one transaction. The reads run in a thread: on
        # S3 each is a network round trip, which would stall every other activity (and their
        # heartbeats) on this worker's event loop.
        try:
            errors = await asyncio.to_thread(self._file_errors, file["object_key"], limits)
        except FileNotFoundError as err:  # the object store lost it: no retry brings it back
            raise ApplicationError(f"The input file {batch['input_file_id']} is missing from the object store.",
                                   non_retryable=True) from err
        try:
            return await self._journal_items(ref, batch, limits, file["object_key"], errors)
        except DataError as err:  # what Postgres will never take: retrying cannot help
            raise ApplicationError(storable(f"Postgres refused the input: {err.orig}"), non_retryable=True) from err
        except Refused as refused:  # nothing of the items was kept: the batch fails whole
            error = dict(code=refused.code, message=refused.message, param=None, line=None)
            async with self.db.begin() as conn:
                await batch_store.move_status(conn, ref.batch_id, "failed", time.time(),
                                              errors=dict(object="list", data=[error]))
            return ValidateResult(0, True)

    async def _journal_items(self, ref: ValidateInput, batch: dict[str, Any], limits: batch_file.FileLimits,
                             key: str, errors: list[batch_file.LineError]) -> ValidateResult:
        async with self.db.begin() as conn:
            if errors:
                await batch_store.move_status(conn, ref.batch_id, "failed", time.time(),
                                              errors=dict(object="list", data=[e.as_openai() for e in errors]))
                return ValidateResult(0, True)
            total, input_tokens, output_tokens = 0, 0, 0
            with await asyncio.to_thread(self.store.open, key) as f:
                pages = _pages(batch_file.scan(f, limits), 1000)
                while page := await asyncio.to_thread(next, pages, None):
                    await batch_store.add_items(conn, ref.batch_id, batch["tenant"], page)
                    total += len(page)
                    for item in page:
                        i, o = self._estimate(batch["endpoint"], item, limits.request)
                        input_tokens, output_tokens = input_tokens + i, output_tokens + o
            await self._enqueue(conn, batch, limits.request.model, input_tokens, output_tokens)
            # Unless a cancel came first (then the lifecycle refuses the move).
            await batch_store.move_status(conn, ref.batch_id, "in_progress", time.time())
        activity.logger.info("batch %s: %d requests", ref.batch_id, total)
        return ValidateResult(total, False)

    async def _pool_limits(self, conn, model: str) -> RequestLimits:
        """The batch's model's limits: this worker's own model's, or another pool's with the
        context length its engine workers announce (a model none ever announced fails every
        line as one this deployment does not serve)."""
        if not model or model == self.limits.model:
            return replace(self.limits, batch_model=bool(model))
        length = (await engine_registry.context_lengths(conn)).get(model)
        if length is None:
            return self.limits
        return RequestLimits(model, length, batch_model=True)

    def _file_errors(self, key: str, limits: batch_file.FileLimits) -> list[batch_file.LineError]:
        with self.store.open(key) as f:
            return batch_file.file_errors(f, limits)

    def _estimate(self, endpoint: str, item: batch_file.Item, limits: RequestLimits) -> tuple[int, int]:
        """(input, output) tokens the item may take; 0 for one that will not run."""
        if item.error is not None:
            return 0, 0
        req = batch_file.parse_line(endpoint, item.body, limits)
        if isinstance(req, ProtocolError):
            return 0, 0
        if isinstance(req, EmbeddingRequest):
            return estimate_embedding(req, limits.max_model_len), 0
        return estimate(req, limits.max_model_len)

    async def _enqueue(self, conn, batch: dict[str, Any], model: str, input_tokens: int, output_tokens: int) -> None:
        """Reserve the batch's tokens and promise its window, or raise Refused: past the
        tenant's enqueued-token limit, or a window its pool cannot meet. Serialised per
        tenant and per pool, so two batches cannot both take the last room."""
        batch_id, tenant = batch["id"], batch["tenant"]
        await ledger.lock_tenant(conn, tenant)
        sets = [s for s in (await ledger.load_limits(conn, tenant)).get(tenant, ())
                if s.model in (ANY_MODEL, model) and s.batch_queue_tokens is not None]
        if sets:
            open_tokens = await ledger.open_batch_tokens(conn, tenant)
            scopes = [(s, sum(open_tokens.values()) if s.model == ANY_MODEL else open_tokens.get(model, 0))
                      for s in sets]
            decision = admit_batch(input_tokens + output_tokens, scopes)
            if isinstance(decision, Refuse):
                raise Refused("token_limit_exceeded", describe_batch(decision, tenant, model))
        await promises.lock_pool(conn, model)
        window = batch["completion_window"]
        # A window no longer offered (the deployment's set changed) is still the batch's own.
        windows = {**self.windows, window: batch["expires_at"] - batch["created_at"]}
        promised = await promises.check(conn, batch_id, model, output_tokens, window, windows, batch["created_at"],
                                        self.promise_share, time.time())
        if isinstance(promised, Unattainable):
            raise Refused("completion_window_unattainable", describe(promised, output_tokens, model))
        await promises.record(conn, batch_id, tenant, window, promised)
        await ledger.insert(conn, [ledger.Entry(ledger.RESERVE, keys.batch(batch_id), tenant, model,
                                                Tier.BATCH, input_tokens, output_tokens)])

    @activity.defn
    async def fail_batch(self, inp: FailBatchInput) -> None:
        """The last word on a batch whose validation or finalization keeps failing."""
        error = dict(code=inp.code, message=storable(inp.message), param=None, line=None)
        async with self.db.begin() as conn:
            await batch_store.move_status(conn, inp.batch_id, "failed", time.time(), errors=dict(object="list",
                                                                                                 data=[error]))
            await ledger.refund(conn, keys.batch(inp.batch_id))

    @activity.defn
    async def pending_items(self, inp: PendingInput) -> list[int] | Page:
        """The next page of pending items; given the queue the batch runs on, with the runs
        of them that share a prefix placed on its live engine workers (policy/grouping.py)."""
        async with self.db.connect() as conn:
            if not inp.queue:
                return await batch_store.pending_items(conn, inp.batch_id, inp.after_idx, inp.limit)
            page = await batch_store.pending_page(conn, inp.batch_id, inp.after_idx, inp.limit, PREFIX_KEY_CHARS)
            live = [e for e in await engine_registry.live(conn, within_s=LIVE_S) if not e["draining"]]
        workers = {}
        for e in live:  # the ones polling the batch's queue: its pool's, or its region's
            region = EngineStats.from_json(e["stats"]).region
            if inp.queue in (e["queue"], region_queue(e["queue"], region)):
                workers[e["id"]] = own_queue(e["queue"], region, e["id"])
        runs = assign([head for _, head in page], workers)
        return Page([idx for idx, _ in page], [(r.count, r.queue) for r in runs])

    @activity.defn
    async def fail_item(self, inp: FailItemInput) -> None:
        body = {"error": dict(message=storable(inp.message), type="server_error", param=None, code=inp.code)}
        # The last word on the item: take its lease first, so that no generation attempt
        # still running somewhere can write after this.
        async with self.db.begin() as conn:
            fence = await acquire(conn, keys.item(inp.batch_id, inp.idx), "fail_item")
        async with self.db.begin() as conn:
            batch = await batch_store.get_batch(conn, inp.batch_id)
            assert batch is not None, f"batch {inp.batch_id} vanished"
            item = await batch_store.get_item(conn, inp.batch_id, inp.idx)
            if item and item["status"] == "pending":
                failed = batch_store.item_failed_event(inp.batch_id, inp.idx, batch["tenant"], inp.status_code, body,
                                                       fence=fence)
                await batch_store.append_one(conn, failed)

    @activity.defn
    async def finalize_batch(self, inp: FinalizeInput) -> str:
        """Write the output and error files in input order, then the final status, which it
        returns: `inp.status`, or `cancelled` when a cancel landed first (see finalize_plan)."""
        async with self.db.begin() as conn:
            batch = await batch_store.get_batch(conn, inp.batch_id, lock=True)
            assert batch is not None, f"batch {inp.batch_id} vanished"
            plan = finalize_plan(batch["status"], inp.status)
            if plan is None:
                return batch["status"]  # a retry after we already finished
            interim, final = plan
            if not await batch_store.move_status(conn, inp.batch_id, interim, inp.at):
                raise RuntimeError(f"batch {inp.batch_id} is {batch['status']}: it cannot be finalized as {final}")
        out_id, err_id = (batch_store.stable_id("file-", inp.batch_id, kind) for kind in ("output", "error"))
        counts = {"output": 0, "error": 0}
        with self.store.writer(keys.file(out_id)) as out, self.store.writer(keys.file(err_id)) as err:
            # Written in a thread a MiB at a time: on S3 a write may upload a part.
            files, held = dict(output=out, error=err), dict(output=bytearray(), error=bytearray())
            async with self.db.connect() as conn:
                async for item, ev in batch_store.results(conn, inp.batch_id):
                    kind, line = self._result_line(inp.batch_id, final, item, ev)
                    held[kind] += line
                    counts[kind] += 1
                    if len(held[kind]) >= MiB:
                        await asyncio.to_thread(files[kind].write, bytes(held[kind]))
                        held[kind].clear()
            for kind, rest in held.items():
                await asyncio.to_thread(files[kind].write, bytes(rest))
        now = int(time.time())
        fields: dict[str, Any] = {}
        async with self.db.begin() as conn:
            # The batch's `output_expires_after`, from the files' creation (OpenAI's anchor).
            lifetime = await batch_store.output_expiry(conn, inp.batch_id)
            for kind, file_id in (("output", out_id), ("error", err_id)):
                if counts[kind]:
                    key = keys.file(file_id)
                    size = await asyncio.to_thread(self.store.size, key)
                    made = dict(id=file_id, tenant=batch["tenant"], purpose="batch_output",
                                filename=f"{inp.batch_id}_{kind}.jsonl", bytes=size, object_key=key, created_at=now)
                    await batch_store.create_file(conn, made, None if lifetime is None else now + lifetime)
                    fields[f"{kind}_file_id"] = file_id
            # The interim status admits no other writer (the API refuses to cancel a
            # finalizing batch, and cancelling only leads here), so this move holds.
            if not await batch_store.move_status(conn, inp.batch_id, final, inp.at, **fields):
                raise RuntimeError(f"batch {inp.batch_id} left {interim} before it could end {final}")
            await ledger.refund(conn, keys.batch(inp.batch_id))  # its enqueued tokens are free again
        return final

    def _result_line(self, batch_id: str, final: str, item: dict[str, Any], ev) -> tuple[str, bytes]:
        head = dict(id=batch_store.stable_id("batch_req_", batch_id, item["idx"]), custom_id=item["custom_id"])
        if ev is None:  # never ran: the batch was cancelled or expired first
            error = dict(code=f"batch_{final}", message=f"This request was not executed because the batch was {final}.")
            return "error", (json.dumps(dict(head, response=None, error=error), ensure_ascii=False) + "\n").encode()
        result = item_result(ev.type, ev.payload)
        status = result.status_code if isinstance(result, ItemFailed) else 200
        req_id = batch_store.stable_id("", batch_id, item["idx"], "request")
        # The body is spliced in as the JSON text the generation wrote (see body_json).
        line = (
            json.dumps(head, ensure_ascii=False)[:-1]
            + f', "response": {{"status_code": {status}, "request_id": "{req_id}", "body": {result.body_json}}}'
            + ', "error": null}\n'
        )
        return ("output" if status == 200 else "error"), line.encode()


class Refused(Exception):
    """The batch cannot be taken: `code` and `message` are its error, as OpenAI's."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _pages(items: Iterator[batch_file.Item | batch_file.LineError], size: int) -> Iterator[list[batch_file.Item]]:
    page: list[batch_file.Item] = []
    for item in items:
        if isinstance(item, batch_file.Item):  # the first pass found no LineError
            page.append(item)
            if len(page) == size:
                yield page
                page = []
    if page:
        yield page
