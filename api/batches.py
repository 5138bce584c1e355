"""/v1/batches: create, retrieve, list and cancel batch jobs (OpenAI Batch API shape)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from api.deps import Services, ServicesDep, TenantDep
from api.errors import APIError, check_metadata, not_found, possible_id, require_id
from api.files import EXPIRES_AFTER_S
from journal import batch_store, promises, tenant_store
from policy.lifecycle import cancellable, estimated_completion, pace_end
from policy.placement import batch_regions, region_queue
from policy.pools import base_model, pool_queue
from policy.promises import Unattainable, describe, priority_key
from protocol import keys
from protocol.requests import ENDPOINTS
from protocol.schema import errors
from protocol.temporal import BatchInput
from storage.objects import ObjectStore
from workflows.batch import BatchWorkflow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches")

FIRST_LINE_BYTES = 1 << 20  # read to find a batch's model: ample for any first request's head


class ExpiresAfter(BaseModel):
    """OpenAI's `output_expires_after`: the batch's output and error files expire this many
    seconds after they are written."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_AFTER_S[0], le=EXPIRES_AFTER_S[1])


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None




async def _current(svc: Services, batch_id: str) -> dict[str, Any]:
    """The batch as it stands now; one this request has just created or moved, so it exists."""
    async with svc.db.connect() as conn:
        row = await batch_store.get_batch(conn, batch_id)
        assert row is not None, f"batch {batch_id} vanished"
        return await batch_object(conn, row, svc)


async def batch_object(conn, row: dict[str, Any], svc: Services) -> dict[str, Any]:
    done = await batch_store.progress(conn, row["id"])
    out = {k: row[k] for k in (
        "id", "endpoint", "model", "errors", "input_file_id", "completion_window", "status", "output_file_id",
        "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
        "failed_at", "expired_at", "cancelling_at", "cancelled_at", "metadata")}
    # Extension fields, beside OpenAI's: how the batch yielded to interactive traffic, the
    # tokens of its completed items and their pace, when it should end at that pace, its
    # workflow in the Temporal UI (BALLAST_TEMPORAL_UI_URL), and what its window was
    # promised on (policy/promises.py; None before validation, or for a batch refused).
    now = time.time()
    started = row["in_progress_at"]
    ran_s = pace_end(row, now) - started if started else 0.0
    ballast = dict(preemptions=done.preemptions, items_preempted=done.items_preempted,
                   input_tokens=done.input_tokens, output_tokens=done.output_tokens,
                   output_tokens_per_s=round(done.output_tokens / ran_s, 3) if ran_s > 0 else None,
                   estimated_completion=estimated_completion(row["status"], started, done.completed + done.failed,
                                                             done.total, now),
                   workflow_url=svc.settings.workflow_url(keys.batch(row["id"])),
                   promise=await promises.get(conn, row["id"]))
    return dict(object="batch", **out, request_counts=done.request_counts(), usage=usage(done), ballast=ballast)


def usage(done: batch_store.Progress) -> dict[str, Any]:
    """OpenAI's batch `usage`: the tokens of the completed items, as their responses state
    them. The engine reports no reasoning tokens apart from the others, so none are."""
    return dict(input_tokens=done.input_tokens, input_tokens_details=dict(cached_tokens=done.cached_tokens),
                output_tokens=done.output_tokens, output_tokens_details=dict(reasoning_tokens=0),
                total_tokens=done.input_tokens + done.output_tokens)


def _links(*operations: str) -> dict:
    """A 200 whose batch id these operations take (OpenAPI links, which schemathesis follows)."""
    return {200: {"description": "The batch object.", "links": {
        op: {"operationId": op, "parameters": {"batch_id": "$response.body#/id"}} for op in operations}}}


@router.post("", operation_id="createBatch",
             responses=_links("retrieveBatch", "cancelBatch") | errors(400, 404, 413, 503))
async def create(body: CreateBatch, svc: ServicesDep, tenant: TenantDep):
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"Unsupported endpoint {body.endpoint!r}; use one of {', '.join(ENDPOINTS)}.",
                       param="endpoint", code="invalid_value")
    windows = svc.settings.windows
    if body.completion_window not in windows:
        raise APIError(400, f"Unsupported completion_window {body.completion_window!r}; use one of "
                       f"{', '.join(repr(w) for w in windows)}.", param="completion_window", code="invalid_value")
    check_metadata(body.metadata)
    require_id("file", body.input_file_id, "input_file_id")
    now = int(time.time())
    row: dict[str, Any] = dict(id="batch_" + uuid.uuid4().hex[:24], tenant=tenant, endpoint=body.endpoint,
                               input_file_id=body.input_file_id, completion_window=body.completion_window,
                               metadata=body.metadata, status="validating", created_at=now,
                               expires_at=now + windows[body.completion_window])
    async with svc.db.connect() as conn:
        f = await batch_store.get_file(conn, body.input_file_id, tenant, now=now)
    if f is None:
        raise not_found("file", body.input_file_id, "input_file_id")
    if f["purpose"] != "batch":
        raise APIError(400, f"File {body.input_file_id} has purpose {f['purpose']!r}; "
                       "a batch needs purpose 'batch'.", param="input_file_id", code="invalid_value")
    s = svc.settings
    # A batch runs one model, as OpenAI's do: its first line's (validation fails the lines
    # that name another), on that model's pool. One no pool serves is checked against the
    # deployment's own, whose validation then says so line by line. Read before the batch
    # exists: nothing is left half made if the store fails.
    first = await asyncio.to_thread(first_model, svc.store, f["object_key"])
    named = base_model(first, await svc.models())
    model = named or s.model_name
    # Whether the window is open at all, behind what is promised on the pool already; its
    # validation promises it, or refuses, once the batch's own tokens are known.
    async with svc.db.connect() as conn:
        open_ = await promises.check(conn, row["id"], model, 0, body.completion_window, windows, now,
                                     s.batch_promise_share, now)
    if isinstance(open_, Unattainable):
        raise APIError(400, describe(open_, 0, model), param="completion_window",
                       code="completion_window_unattainable")
    async with svc.db.begin() as conn:
        # Held until the batch is journaled: a DELETE of the file waits for it, then sees the
        # batch (409); one that came first leaves nothing to hold (404).
        if await batch_store.get_file(conn, body.input_file_id, tenant, now=now, lock=True) is None:
            raise not_found("file", body.input_file_id, "input_file_id")
        lifetime = body.output_expires_after.seconds if body.output_expires_after else None
        # The batch object's `model`: the first line's as written (a fine-tuned model's own
        # name) where a pool serves it; else the deployment's, which its lines are checked against.
        await batch_store.create_batch(conn, row, lifetime, model=first if named else model)
        owner = await tenant_store.get_tenant(conn, tenant)
    pool = pool_queue(s.engine_queue, model)
    queues = [pool]
    if owner and owner.get("regions") is not None:  # fenced: only those regions' engine workers poll these
        regions = batch_regions(frozenset(owner["regions"]), await svc.engines.live(), model)
        queues = [region_queue(pool, r) for r in regions]
    try:
        await svc.temporal.start_workflow(
            BatchWorkflow.run,
            BatchInput(row["id"], row["expires_at"], queues[0], s.batch_concurrency, s.heartbeat_timeout_s,
                       s.batch_items_per_run, s.batch_group_size, tenant=tenant,
                       fairness_weight=float(owner["weight"] if owner else 1), spill_queues=queues[1:],
                       spill_after_s=s.batch_spill_after_s, sticky_wait_s=s.batch_sticky_wait_s, model=named or "",
                       priority_key=priority_key(windows[body.completion_window], windows)),
            id=keys.batch(row["id"]),
            task_queue=s.control_queue,
            search_attributes=svc.attributes("batch", tenant, model, "batch"),
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
    except Exception as err:  # the batch must not sit in `validating` forever
        log.exception("could not start batch %s", row["id"])
        async with svc.db.begin() as conn:
            # What went wrong is in this process's log; the tenant learns only that it did.
            failure = dict(code="unavailable", message="The batch could not be scheduled; create it again.",
                           param=None, line=None)
            await batch_store.move_status(conn, row["id"], "failed", time.time(), errors=dict(object="list",
                                                                                              data=[failure]))
        raise APIError(503, "The batch could not be scheduled; try again shortly.", code="unavailable") from err
    return await _current(svc, row["id"])


def first_model(store: ObjectStore, key: str) -> Any:
    """The `model` the file's first request names; None where it names none readably (its
    validation says what is wrong with it)."""
    head = b""
    try:
        with store.open(key) as f:  # read, not readline: an object store's file may take no bound
            while len(head) < FIRST_LINE_BYTES and (chunk := f.read(min(64 << 10, FIRST_LINE_BYTES - len(head)))):
                head += chunk
                if any(line.strip() for line in head.split(b"\n")[:-1]):
                    break
        line = next((ln for ln in head.split(b"\n") if ln.strip()), b"")
        body = json.loads(line).get("body")
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable, not JSON, not an object
        return None
    return body.get("model") if isinstance(body, dict) else None


@router.get("/{batch_id}", operation_id="retrieveBatch", responses=_links("cancelBatch") | errors(404))
async def retrieve(batch_id: str, svc: ServicesDep, tenant: TenantDep):
    require_id("batch", batch_id, "batch_id")
    async with svc.db.connect() as conn:
        row = await batch_store.get_batch(conn, batch_id, tenant)
        if row is None:
            raise not_found("batch", batch_id, "batch_id")
        return await batch_object(conn, row, svc)


@router.get("", operation_id="listBatches", responses=errors(400))
async def list_(svc: ServicesDep, tenant: TenantDep, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    if after is not None and not possible_id(after):
        rows, data = [], []  # a cursor that cannot exist pages like one that does not: nothing after it
    else:
        async with svc.db.connect() as conn:
            rows = await batch_store.list_batches(conn, tenant, after, limit + 1)
            data = [await batch_object(conn, r, svc) for r in rows[:limit]]
    return dict(object="list", data=data, first_id=data[0]["id"] if data else None,
                last_id=data[-1]["id"] if data else None, has_more=len(rows) > limit)


@router.post("/{batch_id}/cancel", operation_id="cancelBatch", responses=errors(400, 404))
async def cancel(batch_id: str, svc: ServicesDep, tenant: TenantDep):
    """validating or in_progress → cancelling; cancelling again is a no-op that re-signals
    (a lost signal is re-sent by the next call); any later status is a 400."""
    require_id("batch", batch_id, "batch_id")
    async with svc.db.begin() as conn:
        row = await batch_store.get_batch(conn, batch_id, tenant, lock=True)
        if row is None:
            raise not_found("batch", batch_id, "batch_id")
        if row["status"] != "cancelling":
            if not cancellable(row["status"]):
                raise APIError(400, f"Cannot cancel a batch with status {row['status']}.", param="batch_id",
                               code="invalid_state")
            await batch_store.move_status(conn, batch_id, "cancelling", time.time())
    # The journal says `cancelling` first, so the signal only hurries the workflow along:
    # without it the batch still ends `cancelled` when the workflow finalizes.
    try:
        await svc.temporal.get_workflow_handle(keys.batch(batch_id)).signal(BatchWorkflow.cancel)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:  # closed, or never started: nothing to hurry
            log.info("cancel %s: no running workflow (%s)", batch_id, err.message)
        else:
            log.warning("cancel %s: could not signal the workflow, it finalizes as cancelled anyway: %s",
                        batch_id, err)
    return await _current(svc, batch_id)
