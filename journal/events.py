"""Append to and read from the journal.

Every append carries an idempotency key: appending the same key twice writes nothing the
second time, which is what makes Temporal's activity retries safe. Per-stream versions are
assigned here; a concurrent writer that took the version first makes us retry, never
overwrite (optimistic concurrency).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, text
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


_PAGE = 5000  # events per statement

# One round trip per page: skip keys already journaled, number the rest after each
# stream's head, insert. A row that loses a version race to a concurrent writer is
# skipped by ON CONFLICT and retried by `append`.
_APPEND = text(
    """
    WITH n AS (
      SELECT * FROM unnest(CAST(:streams AS text[]), CAST(:types AS text[]), CAST(:payloads AS text[]),
                           CAST(:keys AS text[]), CAST(:tenants AS text[]))
             WITH ORDINALITY AS n(stream, type, payload, key, tenant, ord)
      WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.idempotency_key = n.key)
    )
    INSERT INTO events (stream, version, type, payload, idempotency_key, tenant)
    SELECT stream,
           coalesce((SELECT max(version) FROM events e WHERE e.stream = n.stream), 0)
             + row_number() OVER (PARTITION BY stream ORDER BY ord),
           type, payload::jsonb, key, tenant
    FROM n ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING position, stream, version, type, payload, idempotency_key, tenant
    """
)


async def append(conn: AsyncConnection, new: Sequence[NewEvent], *, attempts: int = 25) -> list[int | None]:
    """Append events in order, inside the caller's transaction; project the new ones.

    Returns each event's position, or None where its key was already in the journal.
    """
    positions: dict[str, int | None] = {e.key: None for e in new}
    if len(positions) != len(new):
        raise ValueError("duplicate idempotency keys in one append")
    todo = list(new)
    for attempt in range(attempts):
        if attempt:  # lost a race for a version: back off a little, with jitter
            await asyncio.sleep(random.uniform(0, 0.002 * attempt))
        inserted: list[Event] = []
        for i in range(0, len(todo), _PAGE):
            page = todo[i : i + _PAGE]
            params = dict(
                streams=[e.stream for e in page], types=[e.type for e in page],
                payloads=[json.dumps(e.payload) for e in page], keys=[e.key for e in page],
                tenants=[e.tenant for e in page],
            )
            inserted += [_event(r) for r in (await conn.execute(_APPEND, params)).all()]
        for e in inserted:
            positions[e.key] = e.position
        await project(conn, sorted(inserted, key=lambda e: e.position))
        done = {e.key for e in inserted}
        todo = [e for e in todo if e.key not in done]
        if todo:  # journaled before (idempotent replays), or beaten to a version (retry)
            todo = [e for e in todo if e.key not in await _existing_keys(conn, [e.key for e in todo])]
        if not todo:
            return [positions[e.key] for e in new]
    raise VersionConflict(f"could not append {len(todo)} events after {attempts} attempts")


async def append_one(conn: AsyncConnection, event: NewEvent) -> int | None:
    return (await append(conn, [event]))[0]


async def read_stream(conn: AsyncConnection, stream: str, *, type: str | None = None) -> list[Event]:
    q = select(events).where(events.c.stream == stream).order_by(events.c.version)
    if type is not None:
        q = q.where(events.c.type == type)
    return [_event(r) for r in (await conn.execute(q)).all()]


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


def _event(r) -> Event:
    m = r._mapping
    return Event(m["position"], m["stream"], m["version"], m["type"], m["payload"], m["idempotency_key"], m["tenant"])
