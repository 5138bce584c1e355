"""What waits, read from the journal for the control worker's gauges (ballast/gauges.py):
the batch backlog per tenant and its oldest open batch, the tokens open batch work holds
per model (the quota fold's view), how long ago the quota fold last ran, and which pools
the fleet controller last called surging; and each tenant's use of every limit set on it.
Each is one query."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.batch_store import OPEN_BATCH
from protocol.events import EventType
from protocol.limits import LIMITS

_OPEN = ", ".join(f"'{s}'" for s in OPEN_BATCH)


@dataclass(frozen=True)
class TenantBacklog:
    tenant: str
    items: int  # pending items of its open batches
    oldest_s: float  # how long its oldest open batch with pending items has existed


async def batch_backlog(conn: AsyncConnection) -> list[TenantBacklog]:
    rows = (await conn.execute(text(f"""
        SELECT b.tenant, count(*), extract(epoch FROM now()) - min(b.created_at)
          FROM batch_items i JOIN batches b ON b.id = i.batch_id
         WHERE i.status = 'pending' AND b.status IN ({_OPEN})
         GROUP BY b.tenant ORDER BY b.tenant"""))).all()
    return [TenantBacklog(tenant, int(n), float(age)) for tenant, n, age in rows]


async def queued_tokens(conn: AsyncConnection) -> dict[str, int]:
    """Model → the tokens its open batch reservations hold, as of the last fold."""
    rows = (await conn.execute(text(
        "SELECT model, sum(batch_queue_tokens) FROM quota_open_sums GROUP BY model ORDER BY model"))).all()
    return {model: int(n) for model, n in rows}


async def fold_age_s(conn: AsyncConnection) -> float | None:
    """Seconds since the quota fold last ran (None: it never has)."""
    return (await conn.execute(text(
        "SELECT extract(epoch FROM now() - folded_at) FROM quota_fold"))).scalar_one_or_none()


async def surging(conn: AsyncConnection) -> dict[str, bool]:
    """Pool → whether its last surge event started a surge (pools never surging: absent)."""
    rows = (await conn.execute(text("""
        SELECT DISTINCT ON (stream) substr(stream, length('fleet:') + 1), type FROM events
         WHERE type IN (:started, :ended) ORDER BY stream, position DESC"""),
        dict(started=EventType.SURGE_STARTED.value, ended=EventType.SURGE_ENDED.value))).all()
    return {pool: kind == EventType.SURGE_STARTED for pool, kind in rows}


@dataclass(frozen=True)
class QuotaUse:
    tenant: str
    model: str  # the limit's scope: a model, or '*' (all the tenant's models together)
    limit: str  # the dimension, a column of `limits`
    used: float
    allowed: int


# Usage as admission counts it against each limit that is set, from the fold's rows (every
# admitting process's, summed) and fine-tuning's settles: the current UTC minute and day
# windows; in-flight requests and queued batch tokens from the latest day row; active jobs
# from their table.
_QUOTA_USE = text("""
    WITH w AS (SELECT date_trunc('minute', now()) AS minute,
                      date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS day,
                      (SELECT max(starts_at) FROM quota_usage WHERE "window" = 'day') AS latest),
    u AS (SELECT q.tenant, q.model,
                 sum(q.requests) FILTER (WHERE q."window" = 'minute' AND q.starts_at = w.minute) AS requests,
                 sum(q.input_tokens) FILTER (WHERE q."window" = 'minute' AND q.starts_at = w.minute) AS input_m,
                 sum(q.output_tokens) FILTER (WHERE q."window" = 'minute' AND q.starts_at = w.minute) AS output_m,
                 sum(q.input_tokens + q.output_tokens) FILTER (WHERE q."window" = 'day' AND q.starts_at = w.day)
                   AS day_tokens,
                 sum(q.in_flight) FILTER (WHERE q."window" = 'day' AND q.starts_at = w.latest) AS in_flight,
                 sum(q.batch_queue_tokens) FILTER (WHERE q."window" = 'day' AND q.starts_at = w.latest) AS queued
            FROM quota_usage q, w GROUP BY q.tenant, q.model
          UNION ALL
          SELECT g.tenant, g.model, 0, 0, 0, sum(g.input_tokens + g.output_tokens), 0, 0
            FROM ledger g, w WHERE g.tier = 'training' AND g.kind = 'settle' AND g.at >= w.day
           GROUP BY g.tenant, g.model),
    f AS (SELECT tenant, model, count(*) AS active FROM fine_tuning_jobs
           WHERE status NOT IN ('succeeded', 'failed', 'cancelled') GROUP BY tenant, model)
    SELECT l.tenant, l.model,
           l.requests_per_min, l.input_tokens_per_min, l.output_tokens_per_min, l.concurrent_requests,
           l.tokens_per_day, l.batch_queue_tokens, l.concurrent_fine_tunes,
           coalesce(s.requests, 0) AS used_requests_per_min, coalesce(s.input_m, 0) AS used_input_tokens_per_min,
           coalesce(s.output_m, 0) AS used_output_tokens_per_min,
           coalesce(s.in_flight, 0) AS used_concurrent_requests, coalesce(s.day_tokens, 0) AS used_tokens_per_day,
           coalesce(s.queued, 0) AS used_batch_queue_tokens,
           coalesce((SELECT sum(f.active) FROM f WHERE f.tenant = l.tenant AND (l.model = '*' OR f.model = l.model)),
                    0) AS used_concurrent_fine_tunes
      FROM limits l
      LEFT JOIN LATERAL (
           SELECT sum(u.requests) AS requests, sum(u.input_m) AS input_m, sum(u.output_m) AS output_m,
                  sum(u.day_tokens) AS day_tokens, sum(u.in_flight) AS in_flight, sum(u.queued) AS queued
             FROM u WHERE u.tenant = l.tenant AND (l.model = '*' OR u.model = l.model)) s ON true
     WHERE CAST(:tenant AS text) IS NULL OR l.tenant = :tenant
     ORDER BY l.tenant, l.model""")


async def quota_use(conn: AsyncConnection, tenant: str | None = None) -> list[QuotaUse]:
    """Each limit that is set (of every tenant, or of one), with what counts against it now."""
    out = []
    for r in (await conn.execute(_QUOTA_USE, dict(tenant=tenant))).mappings():
        out += [QuotaUse(r["tenant"], r["model"], dim, float(r[f"used_{dim}"]), int(r[dim]))
                for dim in LIMITS if r[dim] is not None]
    return out
