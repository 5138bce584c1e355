"""Append to and read from the journal.

Every append carries an idempotency key: appending the same event twice writes nothing the
second time, which is what makes Temporal's activity retries safe; a key already journaled
with other content is an error (`IdempotencyConflict`), never silently dropped. Per-stream
versions are assigned here; a concurrent writer that took the version first makes us
retry, never overwrite (optimistic concurrency). An event fenced with a lease token
(`journal.leases`) is refused by the database once the lease has moved on (`StaleAttempt`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import delete, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.projections import project
from journal.schema import batch_items, batches, events, files, fine_tuning_jobs, reservations
from telemetry import families


@dataclass(frozen=True)
class NewEvent:
    stream: str
    type: str
    payload: dict[str, Any]
    key: str  # idempotency key, globally unique
    tenant: str = "default"
    fence: int | None = None  # the writing attempt's lease token on `stream`; None: unfenced


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


class IdempotencyConflict(RuntimeError):
    """Keys already journaled with another stream, type, payload or tenant: two writers
    disagree about what happened. The caller's transaction must roll back."""

    def __init__(self, keys: Sequence[str]):
        self.keys = tuple(keys)
        shown = ", ".join(map(repr, self.keys[:5])) + (f" and {len(self.keys) - 5} more" if len(self.keys) > 5 else "")
        super().__init__(f"idempotency key {shown} already journaled with different content")


class StaleAttempt(RuntimeError):
    """The database refused an event fenced with a lease token that is no longer current:
    a newer attempt holds the stream. The caller's transaction must roll back."""

    def __init__(self, message: str, stream: str | None = None, fence: int | None = None, current: int | None = None):
        super().__init__(message)
        self.stream, self.fence, self.current = stream, fence, current


class Unfenced(RuntimeError):
    """The database refused an attempt's event (an item's chunk or result, a training
    checkpoint) that carries no fence: a code path that skipped taking the lease."""


STALE_SQLSTATE = "BF001"  # raised by the events_fenced trigger (migrations 0004, 0011)
UNFENCED_SQLSTATE = "BF002"  # likewise, for an attempt's event with no fence (0011)


_PAGE = 5000  # events per statement

# One round trip per page: skip keys already journaled, number the rest after each
# stream's head, insert. A row that loses a version race to a concurrent writer is
# skipped by ON CONFLICT and retried by `append`.
_APPEND = text(
    """
    WITH n AS (
      SELECT * FROM unnest(CAST(:streams AS text[]), CAST(:types AS text[]), CAST(:payloads AS text[]),
                           CAST(:keys AS text[]), CAST(:tenants AS text[]), CAST(:fences AS bigint[]))
             WITH ORDINALITY AS n(stream, type, payload, key, tenant, fence, ord)
      WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.idempotency_key = n.key)
    )
    INSERT INTO events (stream, version, type, payload, idempotency_key, tenant, fence)
    SELECT stream,
           coalesce((SELECT max(version) FROM events e WHERE e.stream = n.stream), 0)
             + row_number() OVER (PARTITION BY stream ORDER BY ord),
           type, payload::jsonb, key, tenant, fence
    FROM n ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING position, version, idempotency_key
    """
)

# Only for events the append skipped: which keys are journaled, and with the same content?
# The payload compares as JSONB, so key order and whitespace do not matter.
_JOURNALED = text(
    """
    SELECT n.key, (e.stream = n.stream AND e.type = n.type AND e.tenant = n.tenant
                   AND e.payload = CAST(n.payload AS jsonb)) AS same
    FROM unnest(CAST(:streams AS text[]), CAST(:types AS text[]), CAST(:payloads AS text[]),
                CAST(:keys AS text[]), CAST(:tenants AS text[])) AS n(stream, type, payload, key, tenant)
    JOIN events e ON e.idempotency_key = n.key
    """
)


async def append(conn: AsyncConnection, new: Sequence[NewEvent], *, attempts: int = 25) -> list[int | None]:
    """Append events in order, inside the caller's transaction; project the new ones.

    Returns each event's position, or None where the same event was already in the
    journal. Raises IdempotencyConflict where a key was journaled with other content, and
    StaleAttempt where a fenced event's lease has moved on; nothing of this call is then
    worth committing.
    """
    t0 = time.perf_counter()
    try:
        return await _append(conn, new, attempts)
    except Exception as err:
        families.APPEND_ERRORS.labels(type(err).__name__).inc()
        raise
    finally:
        families.APPEND.observe(time.perf_counter() - t0)


async def _append(conn: AsyncConnection, new: Sequence[NewEvent], attempts: int) -> list[int | None]:
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
            params = dict(_columns(page), fences=[e.fence for e in page])
            try:
                rows = (await conn.execute(_APPEND, params)).all()
            except DBAPIError as err:
                if (stale := _stale(err)) is not None:
                    raise stale from err
                if isinstance(err.orig, psycopg.Error) and err.orig.sqlstate == UNFENCED_SQLSTATE:
                    raise Unfenced(err.orig.diag.message_primary or str(err.orig)) from err
                raise
            # The payloads are the ones we sent: reading them back would parse every
            # checkpoint's tokens again (most of an append's CPU).
            by_key = {e.key: e for e in page}
            for position, version, key in rows:
                sent = by_key[key]
                inserted.append(Event(position, sent.stream, version, sent.type, sent.payload, key, sent.tenant))
        for ev in inserted:
            positions[ev.key] = ev.position
        await project(conn, sorted(inserted, key=lambda e: e.position))
        done = {e.key for e in inserted}
        todo = [e for e in todo if e.key not in done]
        if todo:  # journaled before (a replay, or a conflict), or beaten to a version (retry)
            journaled = await _journaled(conn, todo)
            # A stale attempt is refused even where its event is already there: whatever it
            # says, it no longer speaks for the stream.
            await _check_fences(conn, [e for e in todo if e.key in journaled and e.fence is not None])
            if conflicts := [k for k, same in journaled.items() if not same]:
                raise IdempotencyConflict(conflicts)
            todo = [e for e in todo if e.key not in journaled]
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


async def follow(conn: AsyncConnection, after: tuple[int, int] = (0, 0),
                 limit: int = 1000) -> list[tuple[tuple[int, int], Event]]:
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


async def _check_fences(conn: AsyncConnection, fenced: Sequence[NewEvent]) -> None:
    if not fenced:
        return
    q = text("SELECT stream, token FROM leases WHERE stream = ANY(CAST(:s AS text[]))")
    current: dict[str, int] = dict((await conn.execute(q, dict(s=sorted({e.stream for e in fenced})))).all())
    for e in fenced:
        if current.get(e.stream) != e.fence:
            raise StaleAttempt(f"stale attempt on {e.stream}: fence {e.fence}, current {current.get(e.stream)}",
                               e.stream, e.fence, current.get(e.stream))


def _columns(page: Sequence[NewEvent]) -> dict[str, list[str]]:
    return dict(
        streams=[e.stream for e in page], types=[e.type for e in page],
        payloads=[json.dumps(e.payload) for e in page], keys=[e.key for e in page],
        tenants=[e.tenant for e in page],
    )


async def _journaled(conn: AsyncConnection, new: Sequence[NewEvent]) -> dict[str, bool]:
    """Key -> whether the journal holds the same event under it, for the keys it holds."""
    found: dict[str, bool] = {}
    for i in range(0, len(new), _PAGE):
        found.update((await conn.execute(_JOURNALED, _columns(new[i : i + _PAGE]))).tuples().all())
    return found


def _stale(err: DBAPIError) -> StaleAttempt | None:
    """The trigger's refusal as StaleAttempt (its DETAIL says which lease); None otherwise."""
    if not isinstance(err.orig, psycopg.Error) or err.orig.sqlstate != STALE_SQLSTATE:
        return None
    diag = err.orig.diag
    try:
        detail = json.loads(diag.message_detail or "{}")
    except ValueError:
        detail = {}
    return StaleAttempt(diag.message_primary or str(err.orig), detail.get("stream"), detail.get("fence"),
                        detail.get("current"))


def _event(r) -> Event:
    m = r._mapping
    return Event(m["position"], m["stream"], m["version"], m["type"], m["payload"], m["idempotency_key"], m["tenant"])


async def rebuild(conn: AsyncConnection, page: int = 5000) -> None:
    """Every read model emptied and projected again from the whole journal."""
    for table in (batch_items, batches, files, fine_tuning_jobs, reservations):
        await conn.execute(delete(table))
    after = 0
    while True:
        rows = (
            await conn.execute(select(events).where(events.c.position > after).order_by(events.c.position).limit(page))
        ).all()
        if not rows:
            return
        await project(conn, [_event(r) for r in rows])
        after = rows[-1].position
