"""`ballast bench fold`: what one quota fold costs on a large ledger, the incremental fold
(`journal.fold.fold`, the QuotaReconciler's every tick) against the full refold it
replaced (the same call with nothing kept: it folds every reservation of the 2-day
horizon, as the fold did before it was incremental and as the first tick after
migration 0006 still does), side by side on the same ledger in one run.

For each ledger size (50k, then grown to 200k rows): requests of the last day written as
the API and the engine worker write them (`ledger.insert`, `ledger.settle`: a reserve and a
settle each, some still open), across tenants, models and API processes
(holders, all alive), and a few batches; then one full fold and ANALYZE (as autovacuum
keeps statistics), not timed. Then ticks: each first writes ~400 rows, not timed (200 new
reservations, and the 200 of the tick before settled), then
folds in one transaction, as the reconciler does (expire, then fold): every
`FULL_EVERY`-th tick the full refold, the others the incremental fold. The figures:
the fold's time (p50, p99; ms) in each arm and their ratio, full over incremental, with
a bootstrap interval (bench.stats); and the tick's (expire + fold). At the end of each
size, the incremental fold's `quota_usage` rows against those a full refold writes at the
same moment (in a transaction rolled back): both arms fold the same thing. The ledger is
append-only, so a size's ticks grow it (200 ticks of ~400 rows: by ~80k rows); the figures
say where it started and ended.

Postgres: a fresh database on BALLAST_DATABASE_URL's server (dropped at the end), else an
embedded server in a temporary directory. Figures last, as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ballast import pg
from bench.stats import p50, p99, ratio_ci
from config import Settings
from config.database import libpq_url
from journal import fold, ledger
from journal.db import connect
from journal.ledger import Entry
from journal.migrate import upgrade
from protocol import keys
from protocol.tiers import Tier

SIZES = (50_000, 200_000)
TICKS = 200  # per size, both arms
FULL_EVERY = 5  # every 5th tick is a full refold: 40 of 200 (each ~1 s at 200k rows)
PER_TICK = 200  # requests admitted (and settled a tick later) per tick: ~400 rows
TENANTS, MODELS, HOLDERS = 20, 3, 8
OPEN_SHARE = 0.02  # of the built ledger's requests, still open
BATCH_EVERY = 1_000  # about one open batch reservation per this many rows built
CHUNK = 10_000  # rows per INSERT while building

_USAGE = text('SELECT tenant, model, "window", starts_at, holder, requests, input_tokens, output_tokens, '
              'in_flight, batch_queue_tokens FROM quota_usage ORDER BY 1, 2, 3, 4, 5')


class Ledger:
    """Writes the bench's ledger rows; remembers the reservations still open."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.holders = [f"bench-api-{i}" for i in range(HOLDERS)]
        self.pending: list[Entry] = []  # reserved at the last tick, settled at the next

    def request(self, at: datetime | None) -> Entry:
        r = self.rng
        return Entry(ledger.RESERVE, keys.request(uuid.uuid4().hex), f"tenant-{r.randrange(TENANTS)}",
                     f"model-{r.randrange(MODELS)}", r.choice(("default", "priority", "flex")),
                     r.randint(20, 2_000), r.randint(16, 1_024), r.choice(self.holders), at)

    def settled(self, e: Entry) -> Entry:
        """The settle of `e` (used no more than held)."""
        i, o = self.rng.randint(0, e.input_tokens), self.rng.randint(0, e.output_tokens)
        return Entry(ledger.SETTLE, e.subject, e.tenant, e.model, e.tier, i, o, e.holder, e.at)

    def built(self, rows: int, now: datetime) -> list[Entry]:
        """About `rows` rows of the last day: requests reserved and settled, a
        share still open, and open batches."""
        out: list[Entry] = []
        while len(out) < rows:
            at = now - timedelta(seconds=self.rng.uniform(5, 86_400))
            if self.rng.random() < 1 / BATCH_EVERY:
                out.append(Entry(ledger.RESERVE, keys.batch(uuid.uuid4().hex),
                                 f"tenant-{self.rng.randrange(TENANTS)}", f"model-{self.rng.randrange(MODELS)}",
                                 Tier.BATCH, self.rng.randint(10_000, 500_000), 0, None, at))
                continue
            e = self.request(at)
            out.append(e)
            if self.rng.random() >= OPEN_SHARE:
                x = self.settled(e)
                out.append(Entry(x.kind, x.subject, x.tenant, x.model, x.tier, x.input_tokens, x.output_tokens,
                                 x.holder, at + timedelta(seconds=self.rng.uniform(0.2, 5))))
        return out

    async def tick_writes(self, db: AsyncEngine) -> int:
        """One tick's traffic, as the API's flusher and the engine worker write it: the
        holders seen, new reservations, the last tick's settled. Rows written."""
        fresh = [self.request(None) for _ in range(PER_TICK)]
        written = 0
        async with db.begin() as conn:
            for h in self.holders:
                await ledger.seen(conn, h)
            written += len(await ledger.insert(conn, fresh))
        async with db.begin() as conn:
            for e in self.pending:
                await ledger.settle(conn, self.settled(e))
        written += len(self.pending)
        self.pending = fresh
        return written


async def build(db: AsyncEngine, owner_url: str, book: Ledger, rows: int) -> None:
    async with db.connect() as conn:
        now = (await conn.execute(text("SELECT now()"))).scalar_one()
    entries = book.built(rows, now)
    for at in range(0, len(entries), CHUNK):
        async with db.begin() as conn:
            await ledger.insert(conn, entries[at:at + CHUNK])
    async with db.begin() as conn:  # the API processes are alive: nothing expires
        for h in book.holders:
            await ledger.seen(conn, h)
    await tick(db, full=True)
    with psycopg.connect(libpq_url(owner_url), autocommit=True) as owner:  # statistics, as autovacuum keeps them
        owner.execute("ANALYZE")


async def tick(db: AsyncEngine, *, full: bool, ttl_s: float = 30.0) -> tuple[float, float]:
    """One reconciler tick in one transaction (expire, then fold); `full`: with what the
    fold keeps deleted first, so it folds the whole horizon. Seconds: (fold, tick)."""
    async with db.begin() as conn:
        t0 = time.perf_counter()
        await fold.expire(conn, ttl_s)
        if full:
            await conn.execute(text("DELETE FROM quota_fold"))
        t1 = time.perf_counter()
        await fold.fold(conn)
        t2 = time.perf_counter()
    return t2 - t1, t2 - t0


async def same_as_full(db: AsyncEngine) -> bool:
    """The incremental fold's rows, then a full refold's by the same clock (the
    transaction's), rolled back."""
    async with db.connect() as conn:
        tx = await conn.begin()
        try:
            await fold.fold(conn)
            incremental = (await conn.execute(_USAGE)).all()
            await conn.execute(text("DELETE FROM quota_fold"))
            await fold.fold(conn)
            full = (await conn.execute(_USAGE)).all()
        finally:
            await tx.rollback()
    return bool(incremental) and incremental == full


async def rows_in(db: AsyncEngine) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM ledger"))).scalar_one())


def ms(xs: list[float], stat: Any) -> float:
    return round(1000 * stat(xs), 2)


async def measure(db: AsyncEngine, book: Ledger, ticks: int) -> dict[str, Any]:
    start = await rows_in(db)
    folds: dict[str, list[float]] = dict(incremental=[], full=[])
    whole: dict[str, list[float]] = dict(incremental=[], full=[])
    new_rows: list[int] = []
    for i in range(ticks):
        new_rows.append(await book.tick_writes(db))
        arm = "full" if i % FULL_EVERY == FULL_EVERY - 1 else "incremental"
        f, t = await tick(db, full=arm == "full")
        folds[arm].append(f)
        whole[arm].append(t)
    inc, full = folds["incremental"], folds["full"]
    return dict(
        ledger_rows=start, ledger_rows_end=await rows_in(db), new_rows_per_tick=round(sum(new_rows) / len(new_rows)),
        incremental_ticks=len(inc), full_ticks=len(full),
        incremental_p50_ms=ms(inc, p50), incremental_p99_ms=ms(inc, p99),
        full_p50_ms=ms(full, p50), full_p99_ms=ms(full, p99),
        full_over_incremental_p50=ratio_ci(full, inc, p50).as_dict(),
        full_over_incremental_p99=ratio_ci(full, inc, p99).as_dict(),
        tick_incremental_p50_ms=ms(whole["incremental"], p50), tick_incremental_p99_ms=ms(whole["incremental"], p99),
        tick_full_p50_ms=ms(whole["full"], p50), tick_full_p99_ms=ms(whole["full"], p99),
        same_rows_as_full=await same_as_full(db),
    )


async def run(owner_url: str, service_url: str, sizes: tuple[int, ...] = SIZES, ticks: int = TICKS) -> dict[str, Any]:
    """Each size in turn on one migrated database (grown from one size to the next)."""
    db = connect(service_url, pool_size=2)
    book, out = Ledger(), {}
    try:
        for size in sizes:
            await build(db, owner_url, book, size - await rows_in(db))
            out[str(size)] = await measure(db, book, ticks)
    finally:
        await db.dispose()
    return out


def main(settings: Settings, ticks: int = TICKS) -> int:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-fold-") as tmp:
        server = None
        if settings.database_url:
            server_url = settings.database_url
        else:
            server = pg.EmbeddedPostgres(Path(tmp)).start()
            server_url = server.url
        name = f"ballast_bench_fold_{os.getpid()}"
        db_url = pg.create_database(server_url, name)
        try:
            service_url = settings.model_copy(update=dict(database_url=db_url, service_database_url=None))
            upgrade(db_url, service_url=service_url.require("service_db_url"))
            figures = asyncio.run(run(db_url, service_url.require("service_db_url"), ticks=ticks))
        finally:
            pg.drop_database(server_url, name)
            if server is not None:
                server.stop()
    for f in figures.values():
        print(f"ledger {f['ledger_rows']:,} → {f['ledger_rows_end']:,} rows, ~{f['new_rows_per_tick']} new rows a "
              f"tick: incremental fold p50 {f['incremental_p50_ms']} ms, p99 {f['incremental_p99_ms']} ms "
              f"({f['incremental_ticks']} ticks); full refold p50 {f['full_p50_ms']} ms, p99 {f['full_p99_ms']} ms "
              f"({f['full_ticks']} ticks); full ÷ incremental p50 {f['full_over_incremental_p50']['ratio']}× "
              f"(95% CI {f['full_over_incremental_p50']['ci95']}); whole tick (expire + fold) p50 "
              f"{f['tick_incremental_p50_ms']} vs {f['tick_full_p50_ms']} ms; same rows as a full refold: "
              f"{f['same_rows_as_full']}")
    summary = dict(sizes=figures, full_every=FULL_EVERY, ticks_per_size=ticks,
                   requests_per_tick=PER_TICK, at=datetime.now(UTC).isoformat(timespec="seconds"))
    print(json.dumps(summary))
    return 0 if all(f["same_rows_as_full"] for f in figures.values()) else 1
