"""What waits, read from the journal for the control worker's gauges (ballast/gauges.py):
the batch backlog per tenant and its oldest open batch, the tokens open batch work holds
per model (the quota fold's view), how long ago the quota fold last ran, and which pools
the fleet controller last called surging. Each is one indexed query."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.batch_store import OPEN_BATCH
from protocol.events import EventType

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
