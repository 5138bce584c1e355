"""Group commit: one attempt's conflicting or stale events fail that attempt's futures only;
everyone else's checkpoints in the same commit are written."""

import asyncio
import time

import psycopg
from sqlalchemy.exc import OperationalError

from journal.batch_store import journaled
from journal.checkpointer import Checkpointer
from journal.events import (
    IdempotencyConflict,
    NewEvent,
    StaleAttempt,
    append,
    read_stream,
)
from journal.leases import acquire


def chunk(stream: str, offset: int, runner: str, fence: int) -> NewEvent:
    return NewEvent(stream, "item_chunk", {"offset": offset, "runner": runner}, f"{stream}:chunk:{offset}", fence=fence)


async def lease(db, stream: str, holder: str = "test") -> int:
    """An attempt's chunks carry its lease token: the database takes none without one."""
    async with db.begin() as c:
        return await acquire(c, stream, holder)


async def outcome(f: asyncio.Future):
    try:
        return await f
    except Exception as err:
        return type(err)


async def test_twins_share_a_commit_and_a_conflicting_twin_fails_alone(db):
    s = "item:cp:twins"
    f = await lease(db, s)
    async with Checkpointer(db) as cp:
        # Submitted in one tick: one commit.
        first, twin, clash, other = (cp.submit([chunk(s, 0, "a", f)]), cp.submit([chunk(s, 0, "a", f)]),
                                     cp.submit([chunk(s, 0, "b", f)]), cp.submit([chunk(s, 1, "a", f)]))
        results = [await outcome(f) for f in (first, twin, clash, other)]
    assert results == [[None], [None], IdempotencyConflict, [None]]
    async with db.connect() as c:
        payloads = [e.payload for e in await read_stream(c, s)]
        assert payloads == [{"offset": 0, "runner": "a"}, {"offset": 1, "runner": "a"}]


async def test_a_conflict_with_the_journal_fails_only_its_event(db):
    s = "item:cp:journaled"
    f, other = await lease(db, s), await lease(db, "item:cp:bystander")
    async with db.begin() as c:
        await append(c, [chunk(s, 0, "zombie", f)])
    async with Checkpointer(db) as cp:
        clash, fine = cp.submit([chunk(s, 0, "retry", f)]), cp.submit([chunk("item:cp:bystander", 0, "x", other)])
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
        bystander = cp.submit([chunk("item:cp:stale-bystander", 0, "x", await lease(db, "item:cp:stale-bystander"))])
        assert await outcome(stale) is StaleAttempt
        assert await current == [None] and await bystander == [None]
    async with db.connect() as c:
        assert [e.payload["runner"] for e in await read_stream(c, s)] == ["new"]


async def test_any_other_failure_fails_every_waiting_event(db):
    f = await lease(db, "item:cp:bad")
    async with Checkpointer(db) as cp:
        bad = cp.submit([NewEvent("item:cp:bad", "t", {"x": float("nan")}, "cp-bad")])  # NaN: not JSON to Postgres
        bystander = cp.submit([chunk("item:cp:bad", 0, "x", f)])
        results = [await outcome(bad), await outcome(bystander)]
    assert results[0] is results[1] and issubclass(results[0], Exception)
    async with db.connect() as c:
        assert await read_stream(c, "item:cp:bad") == []


class Outage:
    """The journal's database, unreachable for its first `commits` commits (restarting)."""

    def __init__(self, db, commits: int):
        self.db, self.left = db, commits

    def begin(self):
        if self.left > 0:
            self.left -= 1
            raise OperationalError("INSERT INTO events", {}, psycopg.OperationalError("connection refused"))
        return self.db.begin()


async def test_an_outage_delays_the_commit_and_drops_no_tokens(db):
    """Unreachable Postgres: the commit goes again until it lands, so an item's chunks stay
    contiguous (no tokens counted as saved that never were) and whoever awaits durability
    waits for it instead of failing."""
    gen, down = Producer("item:cp:outage", await lease(db, "item:cp:outage")), Outage(db, commits=3)
    result_fence = await lease(db, "item:cp:outage-result")
    async with Checkpointer(down, interval_s=0.05) as cp:
        with cp.track(gen):
            gen.tokens = list(range(10))
            result = cp.submit([chunk("item:cp:outage-result", 0, "x", result_fence)], urgent=True)
            await asyncio.sleep(0.05)
            gen.tokens += list(range(10, 25))  # produced while the database is away
            assert await asyncio.wait_for(result, 10) == [None]
            await cp.flush()
            cp.soon()
            await asyncio.sleep(0.2)
            await cp.flush()
    assert down.left == 0 and gen.refused == [] and gen.saved == 25
    async with db.connect() as c:
        chunks = [e.payload for e in await read_stream(c, "item:cp:outage")]
        assert len(await read_stream(c, "item:cp:outage-result")) == 1
    assert journaled(chunks)[0] == list(range(25))  # contiguous from 0: nothing skipped


class Producer:
    """A generation as the checkpointer sees it (journal/checkpointer.py `Tracked`)."""

    def __init__(self, stream: str, fence: int):
        self.stream, self.fence, self.saved = stream, fence, 0
        self.tokens: list[int] = []
        self.refused: list[BaseException] = []

    def due(self) -> list[NewEvent]:
        offset, self.saved = self.saved, len(self.tokens)
        if offset == self.saved:
            return []
        return [NewEvent(self.stream, "item_chunk", {"offset": offset, "token_ids": self.tokens[offset:]},
                         f"{self.stream}:chunk:{offset}", fence=self.fence)]

    def committed(self, event: asyncio.Future) -> None:
        def seen(f: asyncio.Future) -> None:
            if (err := f.exception()) is not None:
                self.refused.append(err)

        event.add_done_callback(seen)


async def test_a_crash_loses_at_most_one_interval_and_one_commit_of_tokens(db):
    """The stated bound on recomputation: at any moment, what the journal holds of a live
    generation lags what it produced by at most what it produces in one interval plus one
    commit. Read back with SQL, as a resumed attempt would."""
    interval, every = 0.2, 0.005  # a token every 5 ms: 40 per interval
    gen = Producer("item:cp:bound", await lease(db, "item:cp:bound"))
    commits: list[float] = []
    lags = []
    took = 0.0

    async def produce():
        nonlocal took
        t0 = time.monotonic()
        for t in range(600):
            gen.tokens.append(t)
            await asyncio.sleep(every)
        took = time.monotonic() - t0  # 3 s, or longer where the machine is busy

    async def journaled() -> int:
        async with db.connect() as c:
            return sum(len(e.payload["token_ids"]) for e in await read_stream(c, gen.stream))

    async with Checkpointer(db, interval, trace=lambda ev, **f: commits.append(f["ms"] / 1000)) as cp:
        with cp.track(gen):
            producing = asyncio.create_task(produce())
            while not producing.done():
                await asyncio.sleep(0.037)
                produced = len(gen.tokens)  # before the read: the journal can only be behind this
                lags.append((produced - await journaled(), produced))
            await producing
        await cp.submit(gen.due())  # the end of a generation flushes the rest
    assert not gen.refused
    assert await journaled() == 600  # nothing lost, nothing twice
    slowest = max(commits)
    bound = (interval + slowest) / every + 10  # 10 tokens of scheduling slack on a busy machine
    assert max(lag for lag, _ in lags) <= bound, (lags, slowest)
    assert len(commits) <= took / interval + 3  # on the cadence, not per token (600 here)
