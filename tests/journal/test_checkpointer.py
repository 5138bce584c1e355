"""Group commit: one attempt's conflicting or stale events fail that attempt's futures only;
everyone else's checkpoints in the same commit are written."""

import asyncio

from journal.checkpointer import Checkpointer
from journal.events import (
    IdempotencyConflict,
    NewEvent,
    StaleAttempt,
    append,
    read_stream,
)
from journal.leases import acquire


def chunk(stream: str, offset: int, runner: str, fence: int | None = None) -> NewEvent:
    return NewEvent(stream, "item_chunk", {"offset": offset, "runner": runner}, f"{stream}:chunk:{offset}", fence=fence)


async def outcome(f: asyncio.Future):
    try:
        return await f
    except Exception as err:
        return type(err)


async def test_twins_share_a_commit_and_a_conflicting_twin_fails_alone(db):
    s = "item:cp:twins"
    async with Checkpointer(db) as cp:
        # Submitted in one tick: one commit.
        first, twin, clash, other = (cp.submit([chunk(s, 0, "a")]), cp.submit([chunk(s, 0, "a")]),
                                     cp.submit([chunk(s, 0, "b")]), cp.submit([chunk(s, 1, "a")]))
        results = [await outcome(f) for f in (first, twin, clash, other)]
    assert results == [[None], [None], IdempotencyConflict, [None]]
    async with db.connect() as c:
        payloads = [e.payload for e in await read_stream(c, s)]
        assert payloads == [{"offset": 0, "runner": "a"}, {"offset": 1, "runner": "a"}]


async def test_a_conflict_with_the_journal_fails_only_its_event(db):
    s = "item:cp:journaled"
    async with db.begin() as c:
        await append(c, [chunk(s, 0, "zombie")])
    async with Checkpointer(db) as cp:
        clash, fine = cp.submit([chunk(s, 0, "retry")]), cp.submit([chunk("item:cp:bystander", 0, "x")])
        assert await outcome(clash) is IdempotencyConflict
        assert await fine == [None]
    async with db.connect() as c:
        assert [e.payload["runner"] for e in await read_stream(c, s)] == ["zombie"]
        assert len(await read_stream(c, "item:cp:bystander")) == 1


async def test_a_stale_attempt_fails_alone(db):
    s = "item:cp:stale"
    async with db.begin() as c:
        await acquire(c, s, "old")
    async with db.begin() as c:
        token = await acquire(c, s, "new")
    async with Checkpointer(db) as cp:
        stale = cp.submit([chunk(s, 0, "old", fence=token - 1)])
        current = cp.submit([chunk(s, 1, "new", fence=token)])
        bystander = cp.submit([chunk("item:cp:stale-bystander", 0, "x")])
        assert await outcome(stale) is StaleAttempt
        assert await current == [None] and await bystander == [None]
    async with db.connect() as c:
        assert [e.payload["runner"] for e in await read_stream(c, s)] == ["new"]


async def test_any_other_failure_fails_every_waiting_event(db):
    async with Checkpointer(db) as cp:
        bad = cp.submit([NewEvent("item:cp:bad", "t", {"x": float("nan")}, "cp-bad")])  # NaN: not JSON to Postgres
        bystander = cp.submit([chunk("item:cp:bad", 0, "x")])
        results = [await outcome(bad), await outcome(bystander)]
    assert results[0] is results[1] and issubclass(results[0], Exception)
    async with db.connect() as c:
        assert await read_stream(c, "item:cp:bad") == []
