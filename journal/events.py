"""Append to and read from the journal.

Every append carries an idempotency key: appending the same key twice writes nothing the
second time, which is what makes Temporal's activity retries safe. Per-stream versions are
assigned here; a concurrent writer that took the version first makes us retry, never
overwrite (optimistic concurrency).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.projections import project
from journal.schema import events


@dataclass(frozen=True)
class NewEvent:
    stream: str
    type: str
    payload: dict[str, Any]
    key: str  # idempotency key, globally unique
    tenant: str = "default"


@dataclass(frozen=True)
class Event:
    position: int
    stream: str
    version: int
    type: str
    payload: dict[str, Any] = field(repr=False)
    key: str
    tenant: str


class VersionConflict(RuntimeError):
    """Another writer kept taking the versions we computed; give up rather than spin."""


_PAGE = 5000  # rows per INSERT: keeps us far below Postgres' 65535 bind parameters


async def append(conn: AsyncConnection, new: Sequence[NewEvent], *, attempts: int = 25) -> list[int | None]:
    """Append events in order, inside the caller's transaction; project the new ones.

    Returns each event's position, or None where its key was already in the journal.
    """
    positions: dict[str, int | None] = {e.key: None for e in new}
    if len(positions) != len(new):
        raise ValueError("duplicate idempotency keys in one append")
    todo = list(new)
    for attempt in range(attempts):
        if not todo:
            break
        if attempt:  # lost a race for a version: back off a little, with jitter
            await asyncio.sleep(random.uniform(0, 0.002 * attempt))
        known = await _existing_keys(conn, [e.key for e in todo])
        todo = [e for e in todo if e.key not in known]
        heads = await _stream_heads(conn, {e.stream for e in todo})
        rows = []
        for e in todo:
            heads[e.stream] = heads.get(e.stream, 0) + 1
            rows.append(
                dict(stream=e.stream, version=heads[e.stream], type=e.type, payload=e.payload,
                     idempotency_key=e.key, tenant=e.tenant)
            )
        inserted: list[Event] = []
        for i in range(0, len(rows), _PAGE):
            stmt = (
                insert(events)
                .values(rows[i : i + _PAGE])
                .on_conflict_do_nothing()
                .returning(*events.c["position", "stream", "version", "type", "payload", "idempotency_key", "tenant"])
            )
            inserted += [_event(r) for r in (await conn.execute(stmt)).all()]
        for e in inserted:
            positions[e.key] = e.position
        await project(conn, sorted(inserted, key=lambda e: e.position))
        done = {e.key for e in inserted}
        todo = [e for e in todo if e.key not in done]
    if todo:
        raise VersionConflict(f"could not append {len(todo)} events after {attempts} attempts")
    return [positions[e.key] for e in new]


async def append_one(conn: AsyncConnection, event: NewEvent) -> int | None:
    return (await append(conn, [event]))[0]


async def read_stream(conn: AsyncConnection, stream: str, *, type: str | None = None) -> list[Event]:
    q = select(events).where(events.c.stream == stream).order_by(events.c.version)
    if type is not None:
        q = q.where(events.c.type == type)
    return [_event(r) for r in (await conn.execute(q)).all()]


async def read_positions(conn: AsyncConnection, positions: Sequence[int]) -> dict[int, Event]:
    if not positions:
        return {}
    rows = (await conn.execute(select(events).where(events.c.position.in_(positions)))).all()
    return {r.position: _event(r) for r in rows}


async def follow(conn: AsyncConnection, after: tuple[int, int] = (0, 0), limit: int = 1000) -> list[tuple[tuple[int, int], Event]]:
    """Events committed after the cursor `(txid, position)`, in commit-safe order.

    Rows are ordered by the writing transaction and only read below the current
    snapshot's xmin, so a transaction that commits late cannot slip in behind the cursor.
    """
    rows = (
        await conn.execute(
            text(
                """
                SELECT txid::text::bigint AS tx, position, stream, version, type, payload,
                       idempotency_key, tenant
                FROM events
                WHERE (txid::text::bigint, position) > (:tx, :pos)
                  AND txid < pg_snapshot_xmin(pg_current_snapshot())
                ORDER BY txid, position
                LIMIT :limit
                """
            ),
            dict(tx=after[0], pos=after[1], limit=limit),
        )
    ).all()
    return [((r.tx, r.position), _event(r)) for r in rows]


async def _existing_keys(conn: AsyncConnection, keys: list[str]) -> set[str]:
    found: set[str] = set()
    for i in range(0, len(keys), _PAGE):
        q = select(events.c.idempotency_key).where(events.c.idempotency_key.in_(keys[i : i + _PAGE]))
        found |= set((await conn.execute(q)).scalars())
    return found


async def _stream_heads(conn: AsyncConnection, streams: set[str]) -> dict[str, int]:
    heads: dict[str, int] = {}
    names = sorted(streams)
    for i in range(0, len(names), _PAGE):
        q = (
            select(events.c.stream, func.max(events.c.version))
            .where(events.c.stream.in_(names[i : i + _PAGE]))
            .group_by(events.c.stream)
        )
        heads.update({s: v for s, v in (await conn.execute(q)).all()})
    return heads


def _event(r) -> Event:
    m = r._mapping
    return Event(m["position"], m["stream"], m["version"], m["type"], m["payload"], m["idempotency_key"], m["tenant"])
