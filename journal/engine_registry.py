"""The engine directory: engine workers announce themselves; the API reads who is live."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.schema import engines
from protocol.engine_wire import EngineStats


async def announce(conn: AsyncConnection, id: str, url: str, model: str, queue: str,
                   stats: dict[str, Any]) -> tuple[int | None, bool]:
    """Upsert the engine's row; returns the batch cap the fleet controller set on it, and
    whether it is being drained."""
    row = dict(id=id, url=url, model=model, queue=queue, stats=stats)
    stmt = insert(engines).values(row)
    stmt = stmt.on_conflict_do_update(index_elements=[engines.c.id], set_=dict(row, seen_at=func.now()))
    cap, draining = (await conn.execute(stmt.returning(engines.c.batch_cap, engines.c.draining))).one()
    return cap, draining


async def drain(conn: AsyncConnection, id: str, draining: bool = True) -> bool:
    """Mark an engine draining (or serving again); False if there is no such engine. The
    engine worker reads it at its next announcement."""
    done = await conn.execute(engines.update().where(engines.c.id == id).values(draining=draining))
    return done.rowcount == 1


async def set_caps(conn: AsyncConnection, caps: list[tuple[str, int | None]]) -> None:
    for id, cap in caps:
        await conn.execute(engines.update().where(engines.c.id == id).values(batch_cap=cap))


async def withdraw(conn: AsyncConnection, id: str) -> None:
    await conn.execute(engines.delete().where(engines.c.id == id))


async def live(conn: AsyncConnection, within_s: float = 5.0) -> list[dict[str, Any]]:
    q = select(engines).where(engines.c.seen_at > func.now() - text(f"interval '{float(within_s)} seconds'"))
    return [dict(r._mapping) for r in (await conn.execute(q.order_by(engines.c.id))).all()]


async def context_lengths(conn: AsyncConnection) -> dict[str, int]:
    """Model → the shortest context any of its engine workers announced, over every row
    (one that went quiet still says what its pool's model takes)."""
    out: dict[str, int] = {}
    for model, stats in (await conn.execute(select(engines.c.model, engines.c.stats))).all():
        length = int((stats or {}).get("max_model_len") or 0)
        if length:
            out[model] = min(out.get(model, length), length)
    return out


async def batch_pace(conn: AsyncConnection, model: str, within_s: float = 10.0) -> float:
    """The pool's batch pace, output tokens a second: what its live engine workers that
    take new work measured (EngineStats.batch_rate); 0 where none has measured it."""
    return sum(EngineStats.from_json(e["stats"]).batch_rate for e in await live(conn, within_s)
               if e["model"] == model and not e["draining"])
