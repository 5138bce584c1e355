"""The work promised on a pool and the promises made: what admission of a batch's
completion window reads and writes (policy/promises.py decides)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal import engine_registry
from journal.events import NewEvent, append_one
from journal.ledger import HORIZON_S
from journal.schema import events
from policy.promises import Accept, Promised, Unattainable, promise
from protocol import keys
from protocol.events import EventType

# Every open batch of the pool: its reservation's output tokens, scaled by the share of its
# items still pending (an item's own tokens are not known until it settles). A batch whose
# reservation is closed (finalized, failed) or past the ledger's horizon is not counted.
_PROMISED = text(
    """
    SELECT b.id, b.expires_at, r.output_tokens,
           (SELECT count(*) FROM batch_items i WHERE i.batch_id = b.id AND i.status = 'pending') AS pending,
           (SELECT count(*) FROM batch_items i WHERE i.batch_id = b.id) AS total
      FROM ledger r
      JOIN batches b ON r.subject = 'batch:' || b.id
     WHERE r.kind = 'reserve' AND r.tier = 'batch' AND r.model = :model AND b.id <> :batch_id
       AND r.at >= now() - make_interval(secs => :horizon)
       AND NOT EXISTS (SELECT FROM ledger c WHERE c.subject = r.subject AND c.kind IN ('settle', 'refund', 'expire'))
    """
)


async def lock_pool(conn: AsyncConnection, model: str) -> None:
    """Serialise promises on `model`'s pool until the transaction ends: two batches cannot
    both be promised the last of its pace."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('ballast.promise:' || :m, 0))"),
                       dict(m=model))


async def promised(conn: AsyncConnection, model: str, batch_id: str = "") -> list[Promised]:
    """The batches promised on `model`'s pool, but `batch_id`, with what they have left."""
    rows = (await conn.execute(_PROMISED, dict(model=model, batch_id=batch_id, horizon=HORIZON_S))).all()
    return [Promised(r.id, float(r.expires_at), int(r.output_tokens) * int(r.pending) // max(1, int(r.total)))
            for r in rows]


async def record(conn: AsyncConnection, batch_id: str, tenant: str, window: str, accepted: Accept) -> None:
    stream = keys.batch(batch_id)
    payload = dict(batch_id=batch_id, window=window, deadline=accepted.deadline, estimated_at=accepted.estimated_at,
                   ahead=accepted.ahead, rate=accepted.rate)
    await append_one(conn, NewEvent(stream, EventType.BATCH_PROMISED, payload, f"{stream}:promised", tenant))


async def get(conn: AsyncConnection, batch_id: str) -> dict[str, Any] | None:
    """The promise made to `batch_id`; None for a batch not (yet) promised anything."""
    q = select(events.c.payload).where(events.c.idempotency_key == f"{keys.batch(batch_id)}:promised")
    return (await conn.execute(q)).scalar_one_or_none()


async def check(conn: AsyncConnection, batch_id: str, model: str, tokens: int, window: str,
                windows: dict[str, int], created_at: float, share: float, now: float) -> Accept | Unattainable:
    """Whether `batch_id` can be promised `window` on `model`'s pool now (`tokens`: its
    output tokens; 0 before they are known: whether the window is open at all). Call inside
    a transaction holding `lock_pool` where the answer is acted on."""
    rate = await engine_registry.batch_pace(conn, model) * share
    return promise(batch_id, tokens, window, windows, created_at, await promised(conn, model, batch_id), rate, now)
