"""The incremental quota fold against the full recomputation it replaced: after random
reserve / settle / refund / expire writes across tenants, models, holders, tiers and
windows (some in transactions that commit after later ones, some across a rebuild, some
across midnight), `quota_usage` holds, row for row, what the old fold's query computes
from the whole ledger at the same clock."""

from __future__ import annotations

import os
import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ballast import pg
from config.database import SERVICE_ROLE, as_role
from journal import fold, ledger
from journal.db import connect
from journal.ledger import Entry
from journal.migrate import upgrade
from protocol import keys
from tests.helpers import uid

# The oracle: the fold's query before it was incremental (journal/ledger.py, _STANDING and
# _FOLD_INSERT as they were), verbatim but for its INSERT, narrowed to some tenants, and
# with a clock that tests may set (`:clock`, else now()).
_OLD_STANDING = """
    r AS (
      SELECT subject, tenant, model, tier, coalesce(holder, '') AS holder, at, input_tokens AS ri,
             output_tokens AS ro
        FROM ledger
       WHERE kind = 'reserve' AND {where}
    ), x AS (
      SELECT r.tenant, r.model, r.tier, r.holder, r.at, NOT c.closed AS open, r.tier <> 'batch' AS interactive,
             CASE WHEN c.settled THEN c.si WHEN c.closed THEN 0 ELSE r.ri END AS i,
             CASE WHEN c.settled THEN c.so WHEN c.closed THEN 0 ELSE r.ro END AS o,
             r.ri + r.ro AS held
        FROM r CROSS JOIN LATERAL (  -- one index probe (ledger_subject) per reservation
          SELECT count(*) > 0 AS closed, coalesce(bool_or(l.kind = 'settle'), false) AS settled,
                 coalesce(sum(l.input_tokens) FILTER (WHERE l.kind = 'settle'), 0) AS si,
                 coalesce(sum(l.output_tokens) FILTER (WHERE l.kind = 'settle'), 0) AS so
            FROM ledger l
           WHERE l.subject = r.subject AND l.kind IN ('settle', 'refund', 'expire')
        ) c
    )
"""
_OLD_WHERE = "at >= now() - make_interval(secs => :horizon) AND tenant = ANY(:tenants)"
ORACLE = ("WITH" + _OLD_STANDING.format(where=_OLD_WHERE) + """
    SELECT tenant, model, 'minute', date_trunc('minute', at, 'UTC'), holder, count(*), sum(i), sum(o), 0, 0
      FROM x
     WHERE interactive AND at >= date_trunc('minute', now(), 'UTC') - interval '1 minute'
     GROUP BY tenant, model, date_trunc('minute', at, 'UTC'), holder
    UNION ALL
    SELECT tenant, model, 'day', date_trunc('day', now(), 'UTC'), holder,
           count(*) FILTER (WHERE interactive AND today),
           coalesce(sum(i) FILTER (WHERE interactive AND today), 0),
           coalesce(sum(o) FILTER (WHERE interactive AND today), 0),
           count(*) FILTER (WHERE interactive AND open),
           coalesce(sum(held) FILTER (WHERE NOT interactive AND open), 0)
      FROM (SELECT *, at >= date_trunc('day', now(), 'UTC') AS today FROM x) d
     WHERE today OR open
     GROUP BY tenant, model, holder
    """).replace("now()", "coalesce(CAST(:clock AS timestamptz), now())")

# What the fold wrote for the windows it keeps current (it rewrites exactly these).
FOLDED = """
    SELECT tenant, model, "window", starts_at, holder, requests, input_tokens, output_tokens, in_flight,
           batch_queue_tokens
      FROM quota_usage
     WHERE tenant = ANY(:tenants)
       AND (("window" = 'minute' AND starts_at >= date_trunc('minute', {clock}, 'UTC') - interval '1 minute')
            OR ("window" = 'day' AND starts_at >= date_trunc('day', {clock}, 'UTC')))
""".replace("{clock}", "coalesce(CAST(:clock AS timestamptz), now())")



async def usage_rows(conn: AsyncConnection, sql: str, tenants: list[str], clock: datetime | None) -> list[tuple]:
    rows = (await conn.execute(text(sql), dict(tenants=tenants, clock=clock, horizon=ledger.HORIZON_S))).all()
    return sorted((r[0], r[1], r[2], r[3], r[4], *(int(v) for v in r[5:])) for r in rows)


async def assert_folded_as_recomputed(conn: AsyncConnection, tenants: list[str], clock: datetime | None,
                                      context: str) -> list[tuple]:
    got = await usage_rows(conn, FOLDED, tenants, clock)
    want = await usage_rows(conn, ORACLE, tenants, clock)
    assert got == want, f"{context}: incremental fold {got} != full recomputation {want}"
    return got


# Where reservations fall, in seconds from the clock (± 8 s): this minute, the one before,
# earlier this hour and day, yesterday (open ones still count), at the horizon's edge (open
# ones leave it as the clock moves on), beyond it (never count), and a little ahead (an
# admitting process whose clock runs ahead).
OFFSETS_S = (0, -10, -40, -70, -100, -200, -900, -3_000, -86_400 - 200, -2 * 86_400 + 4, -3 * 86_400, 70)
MODELS = ("m", "n")
TIERS = ("default", "priority", "flex", "batch")


@dataclass
class World:
    rng: random.Random
    tenants: list[str]
    holders: list[str | None]  # interactive reservations' (batches have none)
    reserved: list[Entry] = field(default_factory=list)  # committed reservations, any state

    def reservation(self, clock: datetime) -> Entry:
        rng = self.rng
        tier = rng.choice(TIERS)
        batch = tier == "batch"
        subject = keys.batch(uid("b")) if batch else keys.request(uid("r"))
        at = clock + timedelta(seconds=rng.choice(OFFSETS_S) + rng.uniform(-8, 8))
        return Entry(ledger.RESERVE, subject, rng.choice(self.tenants), rng.choice(MODELS), tier,
                     rng.randint(0, 400), rng.randint(0, 400), None if batch else rng.choice(self.holders), at)

    async def write(self, conn: AsyncConnection, clock: datetime, n: int, *, own: bool = False) -> list[Entry]:
        """`n` random writes. `own`: only to reservations this call makes (for a transaction
        left open: it must not wait on rows the others write, nor they on its)."""
        rng = self.rng
        made: list[Entry] = []
        for _ in range(n):
            pool = made if own else self.reserved + made
            op = rng.random()
            if op < 0.4 or not pool:
                e = self.reservation(clock)
                await ledger.insert(conn, [e])
                made.append(e)
                continue
            e = rng.choice(pool)
            if op < 0.6:  # settles (once: the first stands), refunding what it held beyond
                await ledger.settle(conn, Entry(ledger.SETTLE, e.subject, e.tenant, e.model, e.tier,
                                                rng.randint(0, 300), rng.randint(0, 300), e.holder))
            elif op < 0.7:  # refunded whole, if still open
                await ledger.refund(conn, e.subject)
            elif op < 0.78:  # expired (a settle may still come)
                await ledger.insert(conn, [e.closing(ledger.EXPIRE)])
            elif op < 0.84:  # written again by a retry, other figures: the first row stands
                await ledger.insert(conn, [Entry(e.kind, e.subject, e.tenant, e.model, e.tier, 1, 1, e.holder,
                                                 clock)])
            elif op < 0.92:  # the journaling transaction writes the reservation with its settle
                r = self.reservation(clock)
                await ledger.settle(conn, Entry(ledger.SETTLE, r.subject, r.tenant, r.model, r.tier,
                                                rng.randint(0, 300), rng.randint(0, 300), r.holder), r)
                made.append(r)
            else:  # a batch item settles: a subject with no reservation of its own
                await ledger.settle_items(conn, [ledger.ItemUsage(rng.choice(self.tenants), uid("b"), 0,
                                                                  rng.randint(0, 50), rng.randint(0, 50))])
        return made


async def db_now(db) -> datetime:
    async with db.connect() as c:
        return (await c.execute(text("SELECT now()"))).scalar_one()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_incremental_fold_is_the_full_recomputation(db, seed):
    """On the session's database, by its clock, each round: random writes, sometimes a
    transaction that commits only after the next fold (its rows have lower positions than
    rows folded before them); once, a rebuild from scratch; then one reconciler tick
    (expire, fold) and the comparison, in that tick's transaction."""
    dead = uid("h-dead")  # never seen: its open reservations of the horizon expire
    world = World(random.Random(seed), [uid("fa"), uid("fb"), uid("fc")], ["h-fold-a", "h-fold-b", None, dead])
    async with db.begin() as c:
        for h in ("h-fold-a", "h-fold-b"):
            await ledger.seen(c, h)
    late = None
    try:
        for rnd in range(14):
            clock = await db_now(db)
            async with db.begin() as c:
                world.reserved += await world.write(c, clock, world.rng.randint(5, 30))
            if late is None and world.rng.random() < 0.4:
                conn = await db.connect()
                tx = await conn.begin()
                late = (conn, tx, await world.write(conn, clock, world.rng.randint(1, 8), own=True))
            elif late is not None:
                conn, tx, made = late
                late = None
                await tx.commit()
                await conn.close()
                world.reserved += made
            if rnd == 7:  # as after migration 0006: nothing kept, build from the horizon
                async with db.begin() as c:
                    await c.execute(text("DELETE FROM quota_fold"))
            async with db.begin() as c:
                await fold.reconcile(c, holder_ttl_s=3600)
                got = await assert_folded_as_recomputed(c, world.tenants, None, f"seed {seed}, round {rnd}")
                left = (await c.execute(text(
                    "SELECT count(*) FROM open_reservations WHERE holder = :h AND at >= now() - interval '2 days'"),
                    dict(h=dead))).scalar_one()
                assert left == 0  # expiry found every one of them, old and new
    finally:
        if late is not None:  # its rows would hold up whoever writes them next
            await late[1].rollback()
            await late[0].close()
    assert any(r[2] == "day" and r[8] for r in got) and any(r[2] == "minute" for r in got)


async def test_a_reservation_committed_after_a_later_one_is_folded(db):
    """Positions are drawn at INSERT, so a transaction that commits late leaves a lower
    position behind rows already folded: the fold still reads it, at the first tick that
    sees it committed."""
    t = uid("t")
    first, second = keys.request(uid("r")), keys.request(uid("r"))
    await alive(db, "h-late")
    conn = await db.connect()
    tx = await conn.begin()
    await ledger.insert(conn, [Entry(ledger.RESERVE, first, t, "m", "default", 10, 20, "h-late")])
    async with db.begin() as c:
        await ledger.insert(c, [Entry(ledger.RESERVE, second, t, "m", "default", 1, 2, "h-late")])

    async def tick() -> tuple:
        async with db.begin() as c:
            await fold.fold(c)
        return await day_row(db, t)

    try:
        assert await tick() == (1, 1, 2, 1)
        assert await tick() == (1, 1, 2, 1)  # still open: read again, still not there
        await tx.commit()
    finally:
        await conn.close()
    async with db.connect() as c:
        positions = dict((await c.execute(text("SELECT subject, position FROM ledger WHERE subject IN (:a, :b)"),
                                          dict(a=first, b=second))).all())
    assert positions[first] < positions[second]
    assert await tick() == (2, 11, 22, 2)


async def alive(db, holder: str) -> None:
    """Seen just now, so no reconciler on this database (a test stack's, left up while the
    session runs) expires the holder's reservations under the test."""
    async with db.begin() as c:
        await ledger.seen(c, holder)


async def day_row(db, tenant: str) -> tuple:
    async with db.connect() as c:
        return tuple((await c.execute(text(
            "SELECT requests, input_tokens, output_tokens, in_flight FROM quota_usage "
            "WHERE tenant = :t AND \"window\" = 'day'"), dict(t=tenant))).one())


async def test_what_the_folding_transaction_writes_after_the_fold_is_folded_next(db):
    """Its own id is in no snapshot's in-progress list, and once a later transaction has
    ended it is below the snapshot's xmax: the fold records it, and the last position it
    had written."""
    t = uid("t")
    await alive(db, "h-after")
    async with db.begin() as c:
        await ledger.insert(c, [Entry(ledger.RESERVE, keys.request(uid("r")), t, "m", "default", 1, 1,
                                      "h-after")])  # its transaction id is drawn here
        async with db.begin() as other:  # a later id, ended before the fold's snapshot
            await ledger.insert(other, [Entry(ledger.RESERVE, keys.request(uid("r")), uid("t"), "m",
                                              "default", 1, 1, "h-after")])
        await fold.fold(c)
        await ledger.insert(c, [Entry(ledger.RESERVE, keys.request(uid("r")), t, "m", "default", 3, 4,
                                      "h-after")])
    async with db.begin() as c:
        await fold.fold(c)
    assert await day_row(db, t) == (2, 4, 5, 2)


class Interleaved:
    """The caller's connection, but `then` runs right after the statement `after`."""

    def __init__(self, conn: AsyncConnection, after, then):
        self.conn, self.after, self.then = conn, after, then

    async def execute(self, stmt, *args, **kwargs):
        result = await self.conn.execute(stmt, *args, **kwargs)
        if stmt is self.after and self.then is not None:
            then, self.then = self.then, None
            await then()
        return result


async def test_a_reservation_committed_while_a_fold_runs_is_folded_next(db):
    """Committed after the tick read the ledger (so not in this fold) but before the fold
    ended: the snapshot taken before the tick read still has it in progress."""
    t = uid("t")
    await alive(db, "h-during")
    conn = await db.connect()
    tx = await conn.begin()
    try:
        await ledger.insert(conn, [Entry(ledger.RESERVE, keys.request(uid("r")), t, "m", "default", 5, 6,
                                         "h-during")])
        async with db.begin() as c:
            await fold.fold(c)  # a tick (not the first: it reads since a snapshot)
        async with db.begin() as c:
            await fold.fold(Interleaved(c, fold._TICK, tx.commit))
    finally:
        await conn.close()
    async with db.begin() as c:
        await fold.fold(c)
    assert await day_row(db, t) == (1, 5, 6, 1)


async def test_a_holder_that_dies_after_its_reservations_were_folded_has_them_expired(db):
    """Reservations open as the last tick left them (not written since) are expiry's
    candidates too."""
    t, holder = uid("t"), uid("h-dies")
    subjects = [keys.request(uid("r")) for _ in range(2)]
    async with db.begin() as c:
        await ledger.seen(c, holder)
        await ledger.insert(c, [Entry(ledger.RESERVE, s, t, "m", "default", 5, 5, holder) for s in subjects])
    for _ in range(2):  # folded, and folded again: no longer new to the fold
        async with db.begin() as c:
            assert subjects[0] not in (await fold.reconcile(c, holder_ttl_s=30)).expired
    async with db.begin() as c:
        await c.execute(text("UPDATE admission_holders SET seen_at = now() - interval '1 minute' WHERE holder = :h"),
                        dict(h=holder))
        assert sorted((await fold.reconcile(c, holder_ttl_s=30)).expired) == sorted(subjects)
    assert await day_row(db, t) == (2, 0, 0, 0)


@pytest.fixture
async def own_db(pg_server_url):
    """A database of its own: the test below folds by a clock of its choosing, which the
    session's database, folded by its own, must not see."""
    name = f"ballast_test_fold_{uuid.uuid4().hex[:8]}"
    owner = pg.create_database(pg_server_url, name)
    service = as_role(owner, SERVICE_ROLE, os.environ.get("BALLAST_SERVICE_DATABASE_PASSWORD"))
    upgrade(owner, service_url=service)
    engine = connect(service, pool_size=2)
    try:
        yield engine
    finally:
        await engine.dispose()
        pg.drop_database(pg_server_url, name)


@pytest.mark.parametrize("seed", [4, 5])
async def test_the_incremental_fold_crosses_midnight_as_the_full_recomputation(own_db, seed):
    """Ticks every 15–50 s from 23:56 to 00:04 UTC: minute windows end, the day ends, and
    yesterday's reservations count nowhere but in the open sums; after every tick, the
    same rows, and no bucket of a window that has ended."""
    world = World(random.Random(seed), [uid("ma"), uid("mb")], ["h-a", "h-b", None])
    midnight = datetime(2026, 3, 2, tzinfo=UTC)
    clock = midnight - timedelta(minutes=3, seconds=50)
    async with own_db.begin() as c:
        await ledger.insert(c, [Entry(ledger.RESERVE, keys.request(uid("r")), world.tenants[0], "m",
                                      "default", 1, 1, "h-a", midnight - timedelta(minutes=m)) for m in (50, 40, 30)])
    while clock < midnight + timedelta(minutes=4):
        async with own_db.begin() as c:
            world.reserved += await world.write(c, clock, world.rng.randint(3, 20))
        async with own_db.begin() as c:
            await fold.fold(c, now=clock)
            await assert_folded_as_recomputed(c, world.tenants, clock, f"seed {seed}, at {clock:%H:%M:%S}")
        clock += timedelta(seconds=world.rng.uniform(15, 50))
    async with own_db.connect() as c:
        kept = (await c.execute(text("SELECT min(starts_at) FROM quota_buckets"))).scalar_one()
    assert kept >= midnight
