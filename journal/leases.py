"""Leases fence attempts: each attempt at a stream takes the next token, carries it on
every event it appends (`NewEvent(..., fence=token)`), and the database refuses events
fenced with a token that is no longer the stream's current one (`StaleAttempt`), and an
attempt's events that carry no fence at all (migration 0011).

The database draws every token from a sequence the services cannot set (migration 0011):
tokens only rise, across all streams, so the statements here name no token at all.

Take the lease in its own transaction and commit before appending: until that commit,
appends fenced with the previous token wait for it, then fail.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.schema import leases


async def acquire(conn: AsyncConnection, stream: str, holder: str) -> int:
    """Take the stream's lease from whoever held it; returns the new token."""
    stmt = insert(leases).values(stream=stream, holder=holder)
    stmt = stmt.on_conflict_do_update(
        index_elements=[leases.c.stream], set_=dict(holder=stmt.excluded.holder, acquired_at=func.now()),
    )
    return (await conn.execute(stmt.returning(leases.c.token))).scalar_one()


_ACQUIRE_MANY = text(
    """
    INSERT INTO leases (stream, holder)
    SELECT s, :holder FROM unnest(CAST(:streams AS text[])) AS s ORDER BY s  -- one lock order: no deadlocks
    ON CONFLICT (stream) DO UPDATE SET holder = excluded.holder, acquired_at = now()
    RETURNING stream, token
    """
)


async def acquire_many(conn: AsyncConnection, streams: Sequence[str], holder: str) -> dict[str, int]:
    """`acquire` for many streams in one statement (a generation group's items)."""
    if len(set(streams)) != len(streams):
        raise ValueError("a stream appears twice: its lease would be taken twice in one statement")
    rows = await conn.execute(_ACQUIRE_MANY, dict(streams=list(streams), holder=holder))
    return dict(rows.tuples().all())
