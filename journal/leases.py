"""Leases fence attempts: each attempt at a stream takes the next token, carries it on
every event it appends (`NewEvent(..., fence=token)`), and the database refuses events
fenced with a token that is no longer the stream's current one (`StaleAttempt`).

Take the lease in its own transaction and commit before appending: until that commit,
appends fenced with the previous token wait for it, then fail.
"""

from __future__ import annotations

from sqlalchemy import func
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.schema import leases


async def acquire(conn: AsyncConnection, stream: str, holder: str) -> int:
    """Take the stream's lease from whoever held it; returns the new token (first: 1)."""
    stmt = insert(leases).values(stream=stream, token=1, holder=holder)
    stmt = stmt.on_conflict_do_update(
        index_elements=[leases.c.stream],
        set_=dict(token=leases.c.token + 1, holder=stmt.excluded.holder, acquired_at=func.now()),
    )
    return (await conn.execute(stmt.returning(leases.c.token))).scalar_one()
