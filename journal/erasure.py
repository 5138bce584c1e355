"""Erasing a tenant's content, on request, while the journal keeps its audit trail.

What goes: every file the tenant has (uploads, batch outputs and errors, fine-tuning
results: rows and bytes), every checkpoint and adapter of its fine-tuning jobs (their
fine-tuned models are deleted), and, in the journal, the content its events carry: the
requests of its batch items, the tokens generated for them, their response bodies (all
but `usage`), filenames and metadata (migration 0019 says exactly what becomes what).

What stays: every event (its type, stream, tenant, time and counts: the token counts of
each chunk, each response's usage), the ledger, the quota fold, the tenant and its keys.
So `SELECT … FROM ledger` and every audit view answer as before, and the journal's
invariants still hold; one `content_erased` event records the erasure and its counts.

A tenant with work still running (a batch not yet ended, a fine-tuning job not finished)
is refused: cancel it first. Objects go before the journal commits: a failure part-way
leaves the journal as it was, and running it again finishes the job.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from journal import batch_store, finetune_store
from journal.events import NewEvent, append_one
from journal.schema import batches, files, fine_tuning_jobs
from protocol import keys
from protocol.events import EventType
from storage.objects import ObjectStore

log = logging.getLogger(__name__)


class StillRunning(Exception):
    """The tenant has work that still needs its content."""

    def __init__(self, tenant: str, running: list[str]):
        super().__init__(f"tenant {tenant} still has work running: {', '.join(running)}")
        self.running = running


@dataclass(frozen=True)
class Erased:
    """What one erasure removed or masked (the `content_erased` event's payload)."""

    tenant: str
    at: int  # unix seconds
    by: str  # who asked: an admin key's id, or "cli"
    files: int  # file rows deleted, their objects with them
    objects: int  # objects removed in all (files, checkpoints, adapters)
    models: int  # fine-tuned models deleted
    requests: int  # item_created events whose request body was masked
    chunks: int  # item_chunk events whose token ids were masked
    results: int  # item_completed / item_failed events whose body was masked
    filenames: int
    metadata: int


async def running_work(conn: AsyncConnection, tenant: str) -> list[str]:
    """The tenant's batches not yet ended and fine-tuning jobs not yet finished, named."""
    open_batches = (await conn.execute(select(batches.c.id, batches.c.status).where(
        batches.c.tenant == tenant, batches.c.status.in_(batch_store.OPEN_BATCH)).order_by(batches.c.id))).all()
    open_jobs = (await conn.execute(select(fine_tuning_jobs.c.id, fine_tuning_jobs.c.status).where(
        fine_tuning_jobs.c.tenant == tenant, fine_tuning_jobs.c.status.not_in(finetune_store.FINAL))
        .order_by(fine_tuning_jobs.c.id))).all()
    return [f"batch {r.id} ({r.status})" for r in open_batches] + [f"fine-tuning job {r.id} ({r.status})"
                                                                      for r in open_jobs]


async def erase_content(conn: AsyncConnection, store: ObjectStore, tenant: str, by: str, now: float) -> Erased:
    """Erase the tenant's content inside the caller's transaction, objects first (see the
    module): the caller commits. Raises StillRunning where work still needs the content."""
    # The tenant's files, locked: a batch or job being created on one waits for us.
    rows = [dict(r._mapping) for r in (await conn.execute(
        select(files).where(files.c.tenant == tenant).order_by(files.c.id).with_for_update())).all()]
    if running := await running_work(conn, tenant):
        raise StillRunning(tenant, running)
    await batch_store.forget_files(conn, rows, "erased")
    candidates = [r["object_key"] for r in rows]
    jobs = [dict(r._mapping) for r in (await conn.execute(
        select(fine_tuning_jobs).where(fine_tuning_jobs.c.tenant == tenant).order_by(fine_tuning_jobs.c.id))).all()]
    models = 0
    for job in jobs:
        candidates += [c["object_key"] for c in await finetune_store.checkpoints(conn, job["id"])]
        candidates += [f"{keys.adapter(job['id'])}/{name}" for name in keys.ADAPTER_FILES]
        if job["fine_tuned_model"] and job["model_deleted_at"] is None:
            await finetune_store.delete_model(conn, job, int(now))
            models += 1
    masked: dict[str, Any] = (await conn.execute(text("SELECT ballast_erase_content(:t)"), dict(t=tenant))).scalar_one()
    # Objects before the journal commits: a failure rolls the journal back, and a second
    # call finds every row again.
    objects = await asyncio.to_thread(lambda: [k for k in candidates if store.exists(k)])
    await asyncio.to_thread(store.delete, objects)
    done = Erased(tenant=tenant, at=int(now), by=by, files=len(rows), objects=len(objects), models=models, **masked)
    stream = keys.tenant(tenant)
    await append_one(conn, NewEvent(stream, EventType.CONTENT_ERASED, asdict(done),
                                    f"{stream}:erased:{uuid.uuid4().hex}", tenant))
    return done


async def erase_tenant_content(db: AsyncEngine, store: ObjectStore, tenant: str, by: str) -> Erased:
    """Erase the tenant's content (see the module); StillRunning where work needs it."""
    async with db.begin() as conn:
        done = await erase_content(conn, store, tenant, by, time.time())
    log.info("erased the content of tenant %s: %s", tenant, asdict(done))
    return done
