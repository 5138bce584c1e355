"""`ballast bench admission`: local admission against the synchronous baseline, and what
the local view's staleness costs in overshoot. No engine: admission alone.

1. Decision cost. `Admission.reserve` — the object and call the request path uses — in
   local mode (memory only) and in sync mode (one Postgres transaction per decision: the
   tenant's advisory lock, its limits, its exact usage from the ledger, the reserve row),
   for a tenant with limits on every dimension that never refuse. p50/p99 in µs and
   their ratio.
2. Overshoot. P = 4 Admission instances (4 API processes: own holder, flusher,
   refresher) on one database, the reconciler's activity folding the ledger every
   `admission_refresh_s` as the QuotaReconciler workflow does, and 200 clients hammering
   one tenant at its requests-per-minute limit (each: admit, hold 50–150 ms, release;
   refused: back off 20–50 ms). Per minute window: admitted − limit against the declared
   bound (`policy.admission.overshoot_bound`, with the measured peak admission rate of a
   process over any S-long stretch), requests refused while the true count was still
   under the limit (target 0), and the ledger's reserve rows against the count admitted.
   Also the staleness observed against the declared S: every 0.25 s, for each process,
   the age of the oldest admission by another process that its view does not count yet.
   It runs until a window has filled and 3 × S more have passed. And each reconciler
   tick's time (expire + fold, one transaction), which S assumes far under a period.

Postgres: a fresh database on BALLAST_DATABASE_URL's server, else an embedded server in a
temporary directory. Figures last, as one JSON line.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import random
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import psycopg
from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.quota import QuotaActivities
from api.admission import Admission, Ticket
from ballast import pg
from ballast.settings import Settings
from bench.surge import pct
from journal import tenants
from journal.db import as_role, connect, libpq_url
from journal.migrate import upgrade
from policy.admission import MINUTE_S, Refuse, overshoot_bound, window_start
from workflows.inputs import ReconcileInput

LOCAL_DECISIONS = 20_000
SYNC_DECISIONS = 1_000
PROCESSES = 4
CLIENTS = 200
RPM_LIMIT = 6_000
GENEROUS = dict(requests_per_min=10**12, input_tokens_per_min=10**12, output_tokens_per_min=10**12,
                concurrent_requests=10**12, tokens_per_day=10**12)


async def decision_cost(db, settings: Settings, mode: str, tenant: str, n: int) -> list[float]:
    """µs per `reserve` call, `n` calls; each admitted request is released at once."""
    adm = await Admission(db, settings.model_copy(update=dict(admission_mode=mode)),
                          holder=f"bench-{mode}-{uuid.uuid4().hex[:6]}").start()
    model, lat = settings.model_name, []
    try:
        for i in range(n):
            t0 = time.perf_counter_ns()
            got = await adm.reserve(f"{mode}-{i}", tenant, model, "default", 40, 16)
            lat.append((time.perf_counter_ns() - t0) / 1000)
            assert isinstance(got, Ticket), got
            got.release(30, 10)
            await asyncio.sleep(0)  # as between requests: the flusher and refresher get their turn
    finally:
        await adm.stop()
    return lat


async def overshoot(db, settings: Settings, tenant: str) -> dict:
    model, stale_s = settings.model_name, settings.admission_staleness_s
    adms = [await Admission(db, settings, holder=f"bench-p{p}-{uuid.uuid4().hex[:6]}").start()
            for p in range(PROCESSES)]
    truth: Counter[float] = Counter()  # admitted per minute window, across every process
    admitted_at: list[list[float]] = [[] for _ in range(PROCESSES)]
    stats = Counter[str]()
    stop = asyncio.Event()

    folds: list[float] = []  # ms per reconciler tick (expire + fold, one transaction)

    async def reconciler() -> None:  # as workflows/quota.py runs it: at a fixed rate
        acts, env, tick = QuotaActivities(db), ActivityEnvironment(), settings.admission_refresh_s
        while not stop.is_set():
            began = time.monotonic()
            await env.run(acts.reconcile_quota, ReconcileInput(settings.admission_holder_ttl_s, tick))
            folds.append(1000 * (time.monotonic() - began))
            await asyncio.sleep(max(0.001, tick - (time.monotonic() - began)))

    def others_before(p: int, at: float, window: float) -> int:
        return sum(bisect.bisect_right(times, at) - bisect.bisect_left(times, window)
                   for q, times in enumerate(admitted_at) if q != p)

    async def staleness() -> None:
        """For each process: how old is the oldest admission of the others it cannot see?"""
        while not stop.is_set():
            await asyncio.sleep(0.25)
            now = time.time()
            window, day = window_start(now, MINUTE_S), window_start(now, 86_400)
            for p, adm in enumerate(adms):
                own = bisect.bisect_right(admitted_at[p], now) - bisect.bisect_left(admitted_at[p], window)
                seen = adm.usage(tenant, "*", model, window, day).requests - own
                if others_before(p, now, window) <= seen:
                    continue
                lo, hi = window, now  # the moment the others' count first passed what p sees
                while hi - lo > 0.001:
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if others_before(p, mid, window) <= seen else (lo, mid)
                stats["stale_ms"] = max(stats["stale_ms"], round(1000 * (now - hi)))

    async def client(i: int) -> None:
        p, rng = i % PROCESSES, random.Random(i)
        adm = adms[p]
        while not stop.is_set():
            got = await adm.reserve(uuid.uuid4().hex, tenant, model, "priority", 20, 20)
            if isinstance(got, Refuse):
                stats["refused"] += 1
                if truth[window_start(time.time(), MINUTE_S)] + 1 <= RPM_LIMIT:
                    stats["wrongly_refused"] += 1  # the limit still had room: throttled below quota
                await asyncio.sleep(rng.uniform(0.02, 0.05))
                continue
            truth[got.minute] += 1
            admitted_at[p].append(got.at)
            await asyncio.sleep(rng.uniform(0.05, 0.15))  # the request runs
            got.release(20, rng.randint(1, 20))

    folding = asyncio.create_task(reconciler())
    sampling = asyncio.create_task(staleness())
    clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    started, filled_at = time.time(), None
    while True:
        await asyncio.sleep(0.2)
        now = time.time()
        if filled_at is None and any(n >= RPM_LIMIT for n in truth.values()):
            filled_at = now
        if (filled_at is not None and now - filled_at >= 3 * stale_s and now - started >= 10) or now - started > 90:
            break
    stop.set()
    await asyncio.gather(*clients, folding, sampling)
    for adm in adms:
        await adm.stop()
    async with db.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT extract(epoch FROM date_trunc('minute', at, 'UTC'))::float8, count(*) FROM ledger "
            "WHERE tenant = :t AND kind = 'reserve' GROUP BY 1"), dict(t=tenant))).all()
        ledger_rows = (await conn.execute(text("SELECT count(*) FROM ledger"))).scalar_one()
    in_ledger = {float(w): int(n) for w, n in rows}
    # The first tick builds the fold's tables from the horizon (once, as after migration
    # 0006); the others read what the ledger gained since the tick before.
    first, ticks = folds[0], folds[1:] or folds
    peak = max(_most_within(times, stale_s) for times in admitted_at)
    windows = {w: n for w, n in sorted(truth.items())}
    worst = max((n - RPM_LIMIT for n in windows.values()), default=0)
    bound = overshoot_bound(RPM_LIMIT, PROCESSES, peak / stale_s, stale_s)
    return dict(
        seconds=round(time.time() - started, 1), windows=len(windows), filled=filled_at is not None,
        admitted=sum(windows.values()), refused=stats["refused"], per_window=list(windows.values()),
        overshoot=max(0, worst), overshoot_pct=round(100 * max(0, worst) / RPM_LIMIT, 2), bound=bound,
        peak_per_process_in_s=peak, observed_staleness_s=stats["stale_ms"] / 1000,
        wrongly_refused=stats["wrongly_refused"],
        ledger_matches=in_ledger == {float(w): n for w, n in windows.items()},
        fold_first_ms=round(first, 1), fold_p50_ms=round(pct(ticks, 50), 1), fold_p99_ms=round(pct(ticks, 99), 1),
        fold_max_ms=round(max(ticks), 1), folds=len(folds), ledger_rows=ledger_rows,
    )


def _most_within(times: list[float], span_s: float) -> int:
    """The most of `times` inside any `span_s`-long stretch."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > span_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


async def run(settings: Settings, db_url: str) -> dict:
    service_url = as_role(db_url, settings.service_role, settings.service_database_password)
    upgrade(db_url, service_url=service_url)
    db = connect(service_url, pool_size=10)
    try:
        async with db.begin() as conn:
            for t in ("cost-local", "cost-sync", "hammer"):
                await tenants.ensure_tenant(conn, t)
            for t in ("cost-local", "cost-sync"):
                await tenants.set_limits(conn, t, "*", **GENEROUS)
                await tenants.set_limits(conn, t, settings.model_name, **GENEROUS)
            await tenants.set_limits(conn, "hammer", "*", requests_per_min=RPM_LIMIT)
        local = await decision_cost(db, settings, "local", "cost-local", LOCAL_DECISIONS)
        with psycopg.connect(libpq_url(db_url), autocommit=True) as owner:  # statistics, as autovacuum keeps them
            owner.execute("ANALYZE ledger")
        sync = await decision_cost(db, settings, "sync", "cost-sync", SYNC_DECISIONS)
        over = await overshoot(db, settings, "hammer")
    finally:
        await db.dispose()
    figures = dict(
        local_p50_us=round(pct(local, 50), 1), local_p99_us=round(pct(local, 99), 1),
        sync_p50_us=round(pct(sync, 50), 1), sync_p99_us=round(pct(sync, 99), 1),
        sync_over_local_p50=round(pct(sync, 50) / pct(local, 50), 1),
        sync_over_local_p99=round(pct(sync, 99) / pct(local, 99), 1),
        processes=PROCESSES, clients=CLIENTS, rpm_limit=RPM_LIMIT, staleness_s=settings.admission_staleness_s,
        **over,
    )
    figures["within_bound"] = figures["overshoot"] <= figures["bound"]
    return figures


def main(settings: Settings) -> int:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-admission-") as tmp:
        server = None
        if settings.database_url:
            server_url = settings.database_url
        else:
            server = pg.EmbeddedPostgres(Path(tmp)).start()
            server_url = server.url
        name = f"ballast_bench_admission_{os.getpid()}"
        db_url = pg.create_database(server_url, name)
        try:
            f = asyncio.run(run(settings, db_url))
        finally:
            pg.drop_database(server_url, name)
            if server is not None:
                server.stop()
    print(f"decision cost, local (memory only): p50 {f['local_p50_us']} µs, p99 {f['local_p99_us']} µs "
          f"({LOCAL_DECISIONS} decisions)")
    print(f"decision cost, sync (one transaction): p50 {f['sync_p50_us']} µs, p99 {f['sync_p99_us']} µs "
          f"({SYNC_DECISIONS} decisions): {f['sync_over_local_p50']}× local at p50, {f['sync_over_local_p99']}× at p99")
    print(f"overshoot: {PROCESSES} processes, {CLIENTS} clients, limit {RPM_LIMIT} rpm, S = {f['staleness_s']} s: "
          f"windows {f['per_window']} → worst +{f['overshoot']} ({f['overshoot_pct']}%), declared bound "
          f"{f['bound']} (peak {f['peak_per_process_in_s']} admissions per process within S; staleness observed "
          f"{f['observed_staleness_s']} s); "
          f"wrongly refused below quota: {f['wrongly_refused']}; ledger matches: {f['ledger_matches']}")
    print(f"reconciler tick (expire + fold), {f['folds']} ticks, ledger {f['ledger_rows']} rows at the end: "
          f"p50 {f['fold_p50_ms']} ms, p99 {f['fold_p99_ms']} ms, max {f['fold_max_ms']} ms "
          f"(the first, from the horizon: {f['fold_first_ms']} ms)")
    print(json.dumps(f))
    return 0 if f["within_bound"] and f["wrongly_refused"] == 0 and f["ledger_matches"] and f["filled"] else 1
