"""Control-worker activities of a batch: validate, page items, move status, write results.

Every one is idempotent: its journal appends carry keys derived from the batch and item,
and the files it writes are replaced whole under ids derived the same way.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from activities import batch_input
from journal import batches as jb
from journal.objects import ObjectStore
from workflows.inputs import BatchRef, FinalizeInput, ItemFailure, PendingInput, ValidateResult


class BatchActivities:
    def __init__(self, db: AsyncEngine, store: ObjectStore, limits: batch_input.Limits):
        self.db = db
        self.store = store
        self.limits = limits  # endpoint is taken from each batch

    @activity.defn
    async def validate_batch(self, ref: BatchRef) -> ValidateResult:
        async with self.db.connect() as conn:
            batch = await jb.get_batch(conn, ref.batch_id)
            assert batch is not None, f"batch {ref.batch_id} vanished"
            counts = await jb.request_counts(conn, ref.batch_id)
            if counts["total"] or batch["status"] == "failed":  # a retry after we already decided
                return ValidateResult(counts["total"], batch["status"] == "failed")
            file = await jb.get_file(conn, batch["input_file_id"], batch["tenant"])
        limits = batch_input.Limits(batch["endpoint"], self.limits.model, self.limits.max_model_len, self.limits.max_lines)
        with self.store.open(file["object_key"]) as f:
            items, errors = batch_input.parse(f, limits)
        async with self.db.begin() as conn:
            if errors:
                await jb.move_status(conn, ref.batch_id, "failed", time.time(),
                                     errors=dict(object="list", data=[e.as_openai() for e in errors]))
                return ValidateResult(0, True)
            await jb.add_items(conn, ref.batch_id, batch["tenant"], items)
            # Unless a cancel came first (then the lifecycle refuses the move).
            await jb.move_status(conn, ref.batch_id, "in_progress", time.time())
        activity.logger.info("batch %s: %d requests", ref.batch_id, len(items))
        return ValidateResult(len(items), False)

    @activity.defn
    async def pending_items(self, inp: PendingInput) -> list[int]:
        async with self.db.connect() as conn:
            return await jb.pending_items(conn, inp.batch_id, inp.after_idx, inp.limit)

    @activity.defn
    async def fail_item(self, inp: ItemFailure) -> None:
        body = {"error": dict(message=inp.message, type="server_error", param=None, code=inp.code)}
        async with self.db.begin() as conn:
            batch = await jb.get_batch(conn, inp.batch_id)
            item = await jb.get_item(conn, inp.batch_id, inp.idx)
            if item and item["status"] == "pending":
                await jb.append_one(conn, jb.item_failed_event(inp.batch_id, inp.idx, batch["tenant"], inp.status_code, body))

    @activity.defn
    async def finalize_batch(self, inp: FinalizeInput) -> None:
        """Write the output and error files in input order, then the final status."""
        async with self.db.begin() as conn:
            if inp.status == "completed":
                await jb.move_status(conn, inp.batch_id, "finalizing", inp.at)
            batch = await jb.get_batch(conn, inp.batch_id)
        if batch["status"] in ("completed", "cancelled", "expired", "failed"):
            return  # a retry after we already finished
        out_id, err_id = (jb.stable_id("file-", inp.batch_id, kind) for kind in ("output", "error"))
        counts = {"output": 0, "error": 0}
        with self.store.writer(f"files/{out_id}") as out, self.store.writer(f"files/{err_id}") as err:
            async with self.db.connect() as conn:
                async for item, ev in jb.results(conn, inp.batch_id):
                    kind, line = self._result_line(inp, item, ev)
                    (out if kind == "output" else err).write(line)
                    counts[kind] += 1
        now = int(time.time())
        fields: dict[str, Any] = {}
        async with self.db.begin() as conn:
            for kind, file_id in (("output", out_id), ("error", err_id)):
                if counts[kind]:
                    key = f"files/{file_id}"
                    await jb.create_file(conn, dict(id=file_id, tenant=batch["tenant"], purpose="batch_output",
                                                    filename=f"{inp.batch_id}_{kind}.jsonl",
                                                    bytes=self.store.size(key), object_key=key, created_at=now))
                    fields[f"{kind}_file_id"] = file_id
            await jb.move_status(conn, inp.batch_id, inp.status, inp.at, **fields)

    def _result_line(self, inp: FinalizeInput, item: dict[str, Any], ev) -> tuple[str, bytes]:
        head = dict(id=jb.stable_id("batch_req_", inp.batch_id, item["idx"]), custom_id=item["custom_id"])
        if ev is None:  # never ran: the batch was cancelled or expired first
            error = dict(code=f"batch_{inp.status}", message=f"This request was not executed because the batch was {inp.status}.")
            return "error", (json.dumps(dict(head, response=None, error=error), ensure_ascii=False) + "\n").encode()
        status = 200 if ev.type == "item_completed" else ev.payload["status_code"]
        req_id = jb.stable_id("", inp.batch_id, item["idx"], "request")
        # The body is spliced in as the JSON text the generation wrote (see body_json).
        line = (
            json.dumps(head, ensure_ascii=False)[:-1]
            + f', "response": {{"status_code": {status}, "request_id": "{req_id}", "body": {ev.payload["body_json"]}}}'
            + ', "error": null}\n'
        )
        return ("output" if status == 200 else "error"), line.encode()
