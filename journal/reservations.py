"""Reserved capacity: a tenant's sequence slots on a model's pool, or output tokens a second
there, anywhere in it or in one region, set by an admin. Every change is a `reservation_set` event (the history);
`reservations` holds the ones in force."""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.events import NewEvent, append_one
from journal.schema import events, reservations
from protocol.events import EventType


def _stream(tenant: str, model: str) -> str:
    return f"reservation:{tenant}:{model}"


async def set_reservation(conn: AsyncConnection, tenant: str, model: str, slots: int, by: str | None,
                    region: str = "", tokens_per_s: int = 0) -> dict[str, Any]:
    """Journal `tenant`'s reservation on `model` (in `region`; "": anywhere) as `slots`, or
    as `tokens_per_s` output tokens a second with `slots` 0 (both 0: none); returns the change."""
    stream = _stream(tenant, model)
    change = dict(tenant=tenant, model=model, region=region, slots=slots, tokens_per_s=tokens_per_s, by=by,
                  at=int(time.time()))
    await append_one(conn, NewEvent(stream, EventType.RESERVATION_SET, change, f"{stream}:{uuid.uuid4().hex}",
                                    tenant))
    return change


async def in_force(conn: AsyncConnection, *, tenant: str | None = None, model: str | None = None) -> list[dict]:
    q = select(reservations).order_by(reservations.c.model, reservations.c.tenant, reservations.c.region)
    if tenant is not None:
        q = q.where(reservations.c.tenant == tenant)
    if model is not None:
        q = q.where(reservations.c.model == model)
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def history(conn: AsyncConnection, tenant: str) -> list[dict[str, Any]]:
    """Every change to `tenant`'s reservations, oldest first."""
    q = (select(events.c.payload).where(events.c.type == EventType.RESERVATION_SET, events.c.tenant == tenant)
         .order_by(events.c.position))
    changes = (await conn.execute(q)).scalars().all()
    return [dict(p, region=p.get("region", ""), tokens_per_s=p.get("tokens_per_s", 0)) for p in changes]
