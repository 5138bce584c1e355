"""Fine-tuning jobs in the journal: stream `ftjob:<id>`.

- `ft_job_created` (the job as created) and `ft_status` (each status it reaches, with its
  own `at`) project into `fine_tuning_jobs`;
- `ft_checkpoint`: a chunk's checkpoint (its step, object key, SHA-256, and the losses of
  the steps it trained), fenced by the training attempt's lease on the stream, keyed by
  step: a retried chunk that redoes the same steps writes the same bytes and the same key;
- `ft_event`: what the job's `/events` shows (level, message, at).

Each checkpoint also settles the tokens its steps trained in the quota ledger (tier
`training`, subject `ftjob:<id>:<step>`), in the same transaction.

Audit in SQL: `SELECT payload FROM events WHERE stream = 'ftjob:<id>' ORDER BY version`.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.events import NewEvent, append_one, read_stream
from journal.schema import events, fine_tuning_jobs
from protocol import keys
from protocol.events import EventType

CREATED, STATUS, CHECKPOINT, EVENT = (EventType.FT_JOB_CREATED, EventType.FT_STATUS, EventType.FT_CHECKPOINT,
                                      EventType.FT_EVENT)
FINAL = ("succeeded", "failed", "cancelled")










def fine_tuned_name(job: dict[str, Any]) -> str:
    """`ft:<base>:<suffix>:<id>`, OpenAI's shape without the organization."""
    return keys.fine_tuned(job["model"], job.get("suffix"), job["id"])


def created_event(row: dict[str, Any]) -> NewEvent:
    return NewEvent(keys.ftjob(row["id"]), CREATED, row, f"{keys.ftjob(row['id'])}:created", row["tenant"])


def status_event(job_id: str, tenant: str, status: str, nth: int, **fields: Any) -> NewEvent:
    """The job's `nth` status change (0 first): a job may be paused and resumed many times."""
    at = fields.pop("at", None) or int(time.time())
    return NewEvent(keys.ftjob(job_id), STATUS, dict(job_id=job_id, status=status, at=at, **fields),
                    f"{keys.ftjob(job_id)}:status:{nth}", tenant)


def checkpoint_event(job_id: str, tenant: str, step: int, key: str, sha256: str, losses: list[float],
                     fence: int | None) -> NewEvent:
    payload = dict(job_id=job_id, step=step, object_key=key, sha256=sha256, losses=losses)
    return NewEvent(keys.ftjob(job_id), CHECKPOINT, payload, f"{keys.ftjob(job_id)}:checkpoint:{step}", tenant,
                    fence=fence)


def job_event(job_id: str, tenant: str, key: str, message: str, level: str = "info", **data: Any) -> NewEvent:
    """A line of the job's /events; `key` makes it once-only (a retried step says it once,
    with the same words: no clock in the payload, the event's committed_at is its time)."""
    payload = dict(job_id=job_id, level=level, message=message, data=data)
    return NewEvent(keys.ftjob(job_id), EVENT, payload, f"{keys.ftjob(job_id)}:event:{key}", tenant)


async def create_job(conn: AsyncConnection, row: dict[str, Any]) -> None:
    await append_one(conn, created_event(row))


async def list_jobs(conn: AsyncConnection, tenant: str, after: str | None, limit: int) -> list[dict[str, Any]]:
    """The tenant's jobs, newest first; `after` is the tenant's own job id (another's pages
    like an unknown one: nothing after it)."""
    q = select(fine_tuning_jobs).where(fine_tuning_jobs.c.tenant == tenant)
    if after is not None:
        cursor = select(fine_tuning_jobs.c.seq).where(fine_tuning_jobs.c.id == after,
                                                      fine_tuning_jobs.c.tenant == tenant).scalar_subquery()
        q = q.where(fine_tuning_jobs.c.seq < cursor)
    q = q.order_by(fine_tuning_jobs.c.seq.desc()).limit(limit)
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def succeeded(conn: AsyncConnection, tenant: str) -> list[dict[str, Any]]:
    """The tenant's jobs that succeeded, oldest first: each is a model it may call."""
    q = select(fine_tuning_jobs).where(
        fine_tuning_jobs.c.tenant == tenant, fine_tuning_jobs.c.status == "succeeded",
        fine_tuning_jobs.c.fine_tuned_model.is_not(None), fine_tuning_jobs.c.model_deleted_at.is_(None)
    ).order_by(fine_tuning_jobs.c.seq)
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def fine_tuned_models(conn: AsyncConnection, tenant: str) -> list[str]:
    return [j["fine_tuned_model"] for j in await succeeded(conn, tenant)]


async def owns_model(conn: AsyncConnection, tenant: str, model: str) -> bool:
    return await model_job(conn, tenant, model) is not None


async def model_job(conn: AsyncConnection, tenant: str, model: str) -> dict[str, Any] | None:
    """The job that trained `model`, one of the tenant's fine-tuned models not deleted."""
    q = select(fine_tuning_jobs).where(fine_tuning_jobs.c.tenant == tenant,
                                       fine_tuning_jobs.c.fine_tuned_model == model,
                                       fine_tuning_jobs.c.status == "succeeded",
                                       fine_tuning_jobs.c.model_deleted_at.is_(None))
    row = (await conn.execute(q)).first()
    return dict(row._mapping) if row else None


async def delete_model(conn: AsyncConnection, job: dict[str, Any], at: int) -> None:
    """Journal that the tenant deleted the job's fine-tuned model (once: the key says so)."""
    stream = keys.ftjob(job["id"])
    await append_one(conn, NewEvent(stream, EventType.FT_MODEL_DELETED,
                                    dict(job_id=job["id"], model=job["fine_tuned_model"], at=at),
                                    f"{stream}:model_deleted", job["tenant"]))


async def get_job(conn: AsyncConnection, job_id: str, tenant: str | None = None) -> dict[str, Any] | None:
    q = select(fine_tuning_jobs).where(fine_tuning_jobs.c.id == job_id)
    if tenant is not None:
        q = q.where(fine_tuning_jobs.c.tenant == tenant)
    row = (await conn.execute(q)).first()
    return dict(row._mapping) if row else None


async def checkpoints(conn: AsyncConnection, job_id: str) -> list[dict[str, Any]]:
    """The job's checkpoints, oldest first (one per step: the key dedups retries), each
    with its position and when it was journaled (`at` in seconds, `at_s` exact)."""
    q = select(events.c.position, events.c.payload, events.c.committed_at).where(
        events.c.stream == keys.ftjob(job_id), events.c.type == CHECKPOINT).order_by(events.c.version)
    return [dict(p, position=pos, at=int(at.timestamp()), at_s=at.timestamp())
            for pos, p, at in (await conn.execute(q)).all()]


async def active_jobs(conn: AsyncConnection, tenant: str, model: str | None = None) -> int:
    """The tenant's jobs not yet ended (on `model`, or on any)."""
    q = select(func.count()).select_from(fine_tuning_jobs).where(
        fine_tuning_jobs.c.tenant == tenant, fine_tuning_jobs.c.status.not_in(FINAL))
    if model is not None:
        q = q.where(fine_tuning_jobs.c.model == model)
    return int((await conn.execute(q)).scalar_one())


async def latest_checkpoints(conn: AsyncConnection, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each job's newest checkpoint (its payload, `at_s` when journaled), for those with one."""
    if not job_ids:
        return {}
    q = select(events.c.stream, events.c.payload, events.c.committed_at).distinct(events.c.stream).where(
        events.c.stream.in_([keys.ftjob(j) for j in job_ids]), events.c.type == CHECKPOINT).order_by(
        events.c.stream, events.c.version.desc())
    return {p["job_id"]: dict(p, at_s=at.timestamp()) for _, p, at in (await conn.execute(q)).all()}


def estimated_finish(status: str, latest: dict[str, Any] | None, now: float) -> int | None:
    """When a running job should end (Unix seconds): its steps left at the pace of its
    last chunk, from that chunk's checkpoint. None before its first checkpoint, and
    unless it runs (a paused or queued job has no pace to go by)."""
    if status != "running" or not latest or "total_steps" not in latest or not latest.get("losses"):
        return None
    per_step = latest.get("timing", {}).get("train_s", 0.0) / len(latest["losses"])
    left = latest["total_steps"] - latest["step"]
    return int(max(now, latest["at_s"] + left * per_step) + 0.5) if per_step > 0 else None


async def job_events(conn: AsyncConnection, job_id: str) -> list[dict[str, Any]]:
    """The job's /events, oldest first: each with its position and when it was journaled."""
    q = select(events.c.position, events.c.payload, events.c.committed_at).where(
        events.c.stream == keys.ftjob(job_id), events.c.type == EVENT).order_by(events.c.version)
    return [dict(p, position=pos, at=int(at.timestamp())) for pos, p, at in (await conn.execute(q)).all()]


async def move_status(conn: AsyncConnection, job: dict[str, Any], status: str, **fields: Any) -> bool:
    """Journal the job's next status unless it has ended already; False if it had."""
    locked = (await conn.execute(select(fine_tuning_jobs.c.status).where(
        fine_tuning_jobs.c.id == job["id"]).with_for_update())).scalar_one()
    if locked in FINAL or locked == status:
        return False
    nth = len(await read_stream(conn, keys.ftjob(job["id"]), type=STATUS))
    await append_one(conn, status_event(job["id"], job["tenant"], status, nth, **fields))
    return True
