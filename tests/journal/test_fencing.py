"""Fenced attempts: once a newer attempt takes a stream's lease, the database refuses the
older attempt's appends, whoever sends them and however they race."""

import asyncio

import psycopg
import pytest
from sqlalchemy import text

from journal.db import libpq_url
from journal.events import NewEvent, StaleAttempt, append, read_stream
from journal.leases import acquire, acquire_many


def chunk(stream: str, key: str, fence: int | None) -> NewEvent:
    return NewEvent(stream, "item_chunk", {"offset": key}, f"{stream}:{key}", fence=fence)


async def take(db, stream: str, holder: str) -> int:
    async with db.begin() as c:
        return await acquire(c, stream, holder)


async def test_a_stale_attempt_is_refused_and_the_current_one_appends(db):
    s = "item:fence:1"
    assert await take(db, s, "attempt-a") == 1
    assert await take(db, s, "attempt-b") == 2

    with pytest.raises(StaleAttempt, match="item:fence:1") as stale:
        async with db.begin() as c:
            await append(c, [chunk(s, "a0", None), chunk(s, "a1", 1)])
    assert (stale.value.stream, stale.value.fence, stale.value.current) == (s, 1, 2)

    async with db.begin() as c:
        await append(c, [chunk(s, "b1", 2)])
    async with db.begin() as c:
        await append(c, [chunk(s, "u1", None)])  # unfenced appends are not the lease's business
    async with db.connect() as c:
        assert [e.key for e in await read_stream(c, s)] == [f"{s}:b1", f"{s}:u1"]


async def test_a_fence_without_a_lease_is_refused(db):
    with pytest.raises(StaleAttempt, match="none"):
        async with db.begin() as c:
            await append(c, [chunk("item:fence:unleased", "x", 1)])


async def test_the_database_itself_refuses_a_stale_insert(db, service_db_url):
    s = "item:fence:raw"
    await take(db, s, "a")
    await take(db, s, "b")
    with psycopg.connect(libpq_url(service_db_url)) as conn:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(
                "INSERT INTO events (stream, version, type, payload, idempotency_key, fence) "
                "VALUES (%s, 1, 'item_chunk', '{}', %s, 1)", (s, f"{s}:raw"),
            )
        assert refused.value.sqlstate == "BF001"
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM events WHERE stream = %s", (s,)).fetchone()[0] == 0


async def test_an_acquire_in_flight_holds_back_the_stale_append(db):
    """The append waits for the acquire and then sees its token: the stale one never lands."""
    s = "item:fence:race"
    await take(db, s, "a")
    async with db.connect() as b:
        async with b.begin():
            assert await acquire(b, s, "b") == 2  # not committed yet
            stale = asyncio.create_task(_append(db, [chunk(s, "a-late", 1)]))
            await asyncio.sleep(0.3)
            assert not stale.done()  # waiting on the lease row
    with pytest.raises(StaleAttempt):
        await stale
    async with db.connect() as c:
        assert await read_stream(c, s) == []


async def test_an_append_in_flight_commits_before_the_next_token(db):
    """The acquire waits for the fenced append: what token 1 wrote commits before token 2 exists."""
    s = "item:fence:race-2"
    await take(db, s, "a")
    async with db.connect() as a:
        async with a.begin():
            await append(a, [chunk(s, "a-first", 1)])
            newer = asyncio.create_task(take(db, s, "b"))
            await asyncio.sleep(0.3)
            assert not newer.done()
    assert await newer == 2
    await _append(db, [chunk(s, "b-next", 2)])
    async with db.connect() as c:
        assert [e.key for e in await read_stream(c, s)] == [f"{s}:a-first", f"{s}:b-next"]


async def _append(db, new):
    async with db.begin() as c:
        return await append(c, new)


async def test_a_group_takes_its_items_leases_in_one_statement_as_one_by_one_would(db):
    await take(db, "item:many:a", "earlier attempt")
    async with db.begin() as c:
        got = await acquire_many(c, ["item:many:b", "item:many:a"], "group attempt")
    assert got == {"item:many:a": 2, "item:many:b": 1}
    async with db.connect() as c:
        rows = (await c.execute(text("SELECT stream, token, holder FROM leases WHERE stream LIKE 'item:many:%' "
                                     "ORDER BY stream"))).tuples().all()
    assert rows == [("item:many:a", 2, "group attempt"), ("item:many:b", 1, "group attempt")]
    with pytest.raises(StaleAttempt):  # the earlier attempt's token no longer writes
        async with db.begin() as c:
            await append(c, [chunk("item:many:a", "late", 1)])
    with pytest.raises(ValueError, match="twice"):
        async with db.begin() as c:
            await acquire_many(c, ["item:many:c", "item:many:c"], "confused")
