"""Fenced attempts: once a newer attempt takes a stream's lease, the database refuses the
older attempt's appends, whoever sends them and however they race."""

import asyncio

import psycopg
import pytest
from sqlalchemy import text

from config.database import libpq_url
from journal.events import NewEvent, StaleAttempt, Unfenced, append, read_stream
from journal.leases import acquire, acquire_many


def chunk(stream: str, key: str, fence: int | None) -> NewEvent:
    return NewEvent(stream, "item_chunk", {"offset": key}, f"{stream}:{key}", fence=fence)


async def take(db, stream: str, holder: str) -> int:
    async with db.begin() as c:
        return await acquire(c, stream, holder)


async def test_a_stale_attempt_is_refused_and_the_current_one_appends(db):
    s = "item:fence:1"
    a = await take(db, s, "attempt-a")
    b = await take(db, s, "attempt-b")
    assert b > a

    with pytest.raises(StaleAttempt, match="item:fence:1") as stale:
        async with db.begin() as c:
            await append(c, [chunk(s, "a1", a)])
    assert (stale.value.stream, stale.value.fence, stale.value.current) == (s, a, b)

    async with db.begin() as c:
        await append(c, [chunk(s, "b1", b)])
    async with db.begin() as c:  # the stream's other events are not the lease's business
        await append(c, [NewEvent(s, "item_note", {}, f"{s}:u1")])
    async with db.connect() as c:
        assert [e.key for e in await read_stream(c, s)] == [f"{s}:b1", f"{s}:u1"]


@pytest.mark.parametrize("type_", ["item_chunk", "item_preempted", "item_completed", "item_failed", "ft_checkpoint"])
async def test_an_attempts_event_without_a_fence_is_refused(db, type_):
    s = f"item:fence:unfenced-{type_}"
    await take(db, s, "a")
    with pytest.raises(Unfenced, match=type_):
        async with db.begin() as c:
            await append(c, [NewEvent(s, type_, {}, f"{s}:x")])
    async with db.connect() as c:
        assert await read_stream(c, s) == []


async def test_a_fence_without_a_lease_is_refused(db):
    with pytest.raises(StaleAttempt, match="none"):
        async with db.begin() as c:
            await append(c, [chunk("item:fence:unleased", "x", 1)])


_RAW_RESULT = ("INSERT INTO events (stream, version, type, payload, idempotency_key, fence) "
               "VALUES (%s, 1, 'item_completed', '{}', %s, %s)")


@pytest.mark.parametrize("which", ["stale", "none", "made up"])
async def test_raw_sql_as_the_service_role_cannot_write_a_stale_or_fenceless_result(db, service_db_url, which):
    s = f"item:fence:raw-{which.replace(' ', '-')}"
    a = await take(db, s, "a")
    b = await take(db, s, "b")
    fence = {"stale": a, "none": None, "made up": b + 1_000_000}[which]
    with psycopg.connect(libpq_url(service_db_url)) as conn:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(_RAW_RESULT, (s, f"{s}:raw", fence))
        assert refused.value.sqlstate == ("BF002" if fence is None else "BF001")
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM events WHERE stream = %s", (s,)).fetchone()[0] == 0


async def test_the_service_role_cannot_choose_a_lease_token(db, service_db_url):
    """Whatever token a statement names, the database assigns the next one from its own
    sequence, which the service role can neither read from nor set."""
    s = "item:fence:forged"
    a = await take(db, s, "a")
    b = await take(db, s, "b")
    with psycopg.connect(libpq_url(service_db_url), autocommit=True) as conn:
        for forged in (a, b + 1_000_000):  # an old holder made current again; a token from the future
            token = conn.execute("UPDATE leases SET token = %s WHERE stream = %s RETURNING token",
                                 (forged, s)).fetchone()[0]
            assert token != forged and token > b
        token = conn.execute("INSERT INTO leases (stream, token, holder) VALUES ('item:fence:forged-new', -5, 'x') "
                             "RETURNING token").fetchone()[0]
        assert token > b
        for sql in ("SELECT nextval('lease_tokens')", "SELECT setval('lease_tokens', 1)",
                    "UPDATE leases SET stream = 'item:fence:elsewhere' WHERE stream = 'item:fence:forged'"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql)
        with pytest.raises(psycopg.Error) as stale:
            conn.execute(_RAW_RESULT, (s, f"{s}:after-forging", a))
        assert stale.value.sqlstate == "BF001"


async def test_a_temporary_table_named_leases_does_not_stand_in_for_the_real_one(db, service_db_url):
    s = "item:fence:shadow"
    a = await take(db, s, "a")
    await take(db, s, "b")
    with psycopg.connect(libpq_url(service_db_url)) as conn:
        try:
            conn.execute("CREATE TEMPORARY TABLE leases (stream text, token bigint, holder text)")
            conn.execute("INSERT INTO leases VALUES (%s, %s, 'shadow')", (s, a))
        except psycopg.errors.InsufficientPrivilege:
            conn.rollback()  # no temporary tables at all: nothing to shadow with
            return
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(_RAW_RESULT, (s, f"{s}:shadowed", a))
        assert refused.value.sqlstate == "BF001"


async def test_an_acquire_in_flight_holds_back_the_stale_append(db):
    """The append waits for the acquire and then sees its token: the stale one never lands."""
    s = "item:fence:race"
    a = await take(db, s, "a")
    async with db.connect() as b:
        async with b.begin():
            assert await acquire(b, s, "b") > a  # not committed yet
            stale = asyncio.create_task(_append(db, [chunk(s, "a-late", a)]))
            await asyncio.sleep(0.3)
            assert not stale.done()  # waiting on the lease row
    with pytest.raises(StaleAttempt):
        await stale
    async with db.connect() as c:
        assert await read_stream(c, s) == []


async def test_an_append_in_flight_commits_before_the_next_token(db):
    """The acquire waits for the fenced append: what the first token wrote commits before
    the next token exists."""
    s = "item:fence:race-2"
    first = await take(db, s, "a")
    async with db.connect() as a:
        async with a.begin():
            await append(a, [chunk(s, "a-first", first)])
            newer = asyncio.create_task(take(db, s, "b"))
            await asyncio.sleep(0.3)
            assert not newer.done()
    second = await newer
    assert second > first
    await _append(db, [chunk(s, "b-next", second)])
    async with db.connect() as c:
        assert [e.key for e in await read_stream(c, s)] == [f"{s}:a-first", f"{s}:b-next"]


async def _append(db, new):
    async with db.begin() as c:
        return await append(c, new)


async def test_a_group_takes_its_items_leases_in_one_statement_as_one_by_one_would(db):
    earlier = await take(db, "item:many:a", "earlier attempt")
    async with db.begin() as c:
        got = await acquire_many(c, ["item:many:b", "item:many:a"], "group attempt")
    assert set(got) == {"item:many:a", "item:many:b"} and got["item:many:a"] > earlier
    async with db.connect() as c:
        rows = (await c.execute(text("SELECT stream, token, holder FROM leases WHERE stream LIKE 'item:many:%' "
                                     "ORDER BY stream"))).tuples().all()
    assert rows == [("item:many:a", got["item:many:a"], "group attempt"),
                    ("item:many:b", got["item:many:b"], "group attempt")]
    with pytest.raises(StaleAttempt):  # the earlier attempt's token no longer writes
        async with db.begin() as c:
            await append(c, [chunk("item:many:a", "late", earlier)])
    with pytest.raises(ValueError, match="twice"):
        async with db.begin() as c:
            await acquire_many(c, ["item:many:c", "item:many:c"], "confused")
