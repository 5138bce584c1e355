"""`ballast bench admission`: local admission against the synchronous baseline, and what
the local view's staleness costs in overshoot across real API processes.

1. Decision cost, in process (no engine). `Admission.reserve` — the object and call the
   request path uses — in local mode (memory only) and in sync mode (one Postgres
   transaction per decision: the tenant's advisory lock, its limits, its exact usage from
   the ledger, the reserve row), for a tenant with limits on every dimension that never
   refuse. p50/p99 in µs and their ratio. Postgres: a fresh database on
   BALLAST_DATABASE_URL's server, else an embedded server in a temporary directory.
2. Overshoot across P = 4 API processes. A fresh `ballast up` (its embedded Postgres,
   Temporal dev server, engine worker with vLLM, control worker with the QuotaReconciler,
   one API process), and P − 1 more `ballast api` processes started with the environment
   `ballast up` gave its own (same database, Temporal, engine token, settings; each its own
   port and holder). Every request goes over HTTP to one of the processes in turn: a chat
   completion of one token, tier `priority` (which may use all of a limit). First a tenant
   without limits measures the rate the stack serves (closed loop, `CLIENTS_PER_PROCESS`
   clients per process). Then two phases, each a tenant of its own with a
   requests-per-minute limit L of what its load admits in `FILL_S`: `paced` (Poisson at
   half the served rate, open loop: the control plane has room) and `saturated` (the
   closed loop; a refused client backs off 100–200 ms). Each runs until a minute window has
   filled at least 3 × S before its end and 3 × S more have passed (S = 2 × flush +
   3 × refresh, docs/quotas-and-audit.md), and the next starts once every request of the last is journaled
   and settled and the fold is fresh.
   The oracle is outside the processes: SQL over the ledger (reserve rows per UTC minute,
   per admitting process) and the client's own record (every accepted request's id, every
   429 with when it was sent and answered). Figures per phase: the largest overshoot of L
   in a window against the documented bound (P − 1) × min(L, what one process admitted within S,
   from the ledger); the client's accepted ids against the ledger's reserve rows; 429s
   answered while the ledger shows the window still had room at the answer (refused below
   quota: target 0; a 429 whose request straddled a minute boundary is not judged); and
   the least staleness the ledger proves: an admission by process p at t, with n reserves
   in its window before t of which p's own are m, means p's view lacked at least
   k = n − L + 1 of the others' (its own count is exact and it admitted), so p had not seen
   the k-th newest of the others' reserves before t: t minus that reserve's time is a lower
   bound on p's staleness then, which S must cover. Beside them, what S assumes: the age of
   the reconciler's last fold (the database's clock, sampled every 0.25 s) and how many of
   the phase's requests were settled by its end.

Figures last, as one JSON line.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import json
import os
import random
import secrets
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg

from api.services.admission import Admission, Ticket
from ballast import pg, procs
from bench.fairness import owner_url
from bench.stack import ballast_up
from bench.stats import pct
from config import Settings
from config.database import as_role, libpq_url
from journal import tenant_store
from journal.db import connect
from journal.migrate import upgrade
from protocol.tiers import Tier

LOCAL_DECISIONS = 20_000
SYNC_DECISIONS = 1_000
PROCESSES = 4
CLIENTS_PER_PROCESS = 16
PROBE_S = 6.0  # how long the unlimited tenant measures the rate the stack serves
FILL_S = 10.0  # the limit is what the load admits in this long
SEED = 7
MINUTE = 60.0
GENEROUS = dict(requests_per_min=10**12, input_tokens_per_min=10**12, output_tokens_per_min=10**12,
                concurrent_requests=10**12, tokens_per_day=10**12)


# -- 1. decision cost, in process ---------------------------------------------------------


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


async def costs(settings: Settings, db_url: str, service_url: str) -> dict:
    upgrade(db_url, service_url=service_url)
    db = connect(service_url, pool_size=10)
    try:
        async with db.begin() as conn:
            for t in ("cost-local", "cost-sync"):
                await tenant_store.ensure_tenant(conn, t)
                await tenant_store.set_limits(conn, t, "*", **GENEROUS)
                await tenant_store.set_limits(conn, t, settings.model_name, **GENEROUS)
        local = await decision_cost(db, settings, "local", "cost-local", LOCAL_DECISIONS)
        with psycopg.connect(libpq_url(db_url), autocommit=True) as owner:  # statistics, as autovacuum keeps them
            owner.execute("ANALYZE ledger")
        sync = await decision_cost(db, settings, "sync", "cost-sync", SYNC_DECISIONS)
    finally:
        await db.dispose()
    return dict(local_p50_us=round(pct(local, 50), 1), local_p99_us=round(pct(local, 99), 1),
                sync_p50_us=round(pct(sync, 50), 1), sync_p99_us=round(pct(sync, 99), 1),
                sync_over_local_p50=round(pct(sync, 50) / pct(local, 50), 1),
                sync_over_local_p99=round(pct(sync, 99) / pct(local, 99), 1))


def decision_costs(settings: Settings) -> dict:
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
            if server is None:  # the services' role and password as configured for that server
                on_db = settings.model_copy(update=dict(database_url=db_url, service_database_url=None))
                return asyncio.run(costs(settings, db_url, on_db.require("service_db_url")))
            # this bench's own server asks every role for a password: one for the run
            password = secrets.token_urlsafe(24)
            service_url = as_role(db_url, settings.service_role, password)
            upgrade(db_url, service_url=service_url)
            pg.set_password(db_url, settings.service_role, password)
            return asyncio.run(costs(settings, db_url, service_url))
        finally:
            pg.drop_database(server_url, name)
            if server is not None:
                server.stop()


# -- 2. overshoot across API processes ------------------------------------------------------


def api_environment(up_pid: int) -> dict[str, str]:
    """The environment `ballast up` gave its own API process (its child running
    `ballast.cli api`), read from /proc: what another API process of that stack needs."""
    for pid in procs.children_of(up_pid):
        try:
            argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            if argv[-2:] != [b"ballast.cli", b"api"]:
                continue
            pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)
    raise RuntimeError(f"no API process among the children of `ballast up` ({up_pid})")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def more_apis(up_pid: int, n: int, log_dir: Path) -> Iterator[list[str]]:
    """`n` more API processes beside the stack's own, each on a port of its own; stopped
    (each by its process group) at the end."""
    env = api_environment(up_pid)
    env.pop(procs.READY_FILE_ENV, None)  # `ballast up`'s supervisor's, not theirs
    children: list[procs.Child] = []
    urls: list[str] = []
    try:
        for i in range(n):
            port = procs.free_port()
            children.append(procs.spawn(f"api {i + 2}", [sys.executable, "-m", "ballast.cli", "api"],
                                        env=dict(env, BALLAST_API_PORT=str(port)),
                                        log_path=log_dir / f"api-{i + 2}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for child, url in zip(children, urls, strict=True):
            procs.wait_until(functools.partial(_healthy, url), 180, f"{child.name} to be healthy", child=child,
                             interval=0.5)
        yield urls
    finally:
        for child in children:
            child.stop(30)


@dataclass(frozen=True)
class Reply:
    api: int  # which process answered
    sent: float  # time.time(): the clock each API process stamps the ledger with (this machine's)
    got: float
    status: int  # 0: no HTTP answer
    id: str = ""  # an accepted request's id (its ledger subject is request:<id>)
    code: str = ""  # an error's code


def body(model: str) -> dict:
    return dict(model=model, messages=[dict(role="user", content="hi")], max_tokens=1, temperature=0,
                service_tier="priority")


async def ask(http: httpx.AsyncClient, api: int, model: str) -> Reply:
    sent = time.time()
    try:
        r = await http.post("/v1/chat/completions", json=body(model))
        got, status = time.time(), r.status_code
        answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    except httpx.HTTPError as err:
        got, status, answer = time.time(), 0, dict(error=dict(code=type(err).__name__))
    if status == 200:
        return Reply(api, sent, got, status, id=answer["id"])
    return Reply(api, sent, got, status, code=str((answer.get("error") or {}).get("code", "")))


@asynccontextmanager
async def clients(urls: list[str], key: str) -> AsyncIterator[list[httpx.AsyncClient]]:
    https = [httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                               limits=httpx.Limits(max_connections=CLIENTS_PER_PROCESS)) for u in urls]
    try:
        yield https
    finally:
        for http in https:
            await http.aclose()


async def drive(urls: list[str], key: str, model: str, stop: asyncio.Event, out: list[Reply],
                rate: float | None = None) -> None:
    """Until `stop`: `CLIENTS_PER_PROCESS` closed-loop clients per API process (a refused
    one backs off 100–200 ms), or with `rate`, requests at that rate in all (Poisson, open
    loop, the processes in turn)."""
    async def closed(i: int, http: httpx.AsyncClient, api: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            out.append(reply := await ask(http, api, model))
            if reply.status != 200:
                await asyncio.sleep(rng.uniform(0.1, 0.2))

    async def one(http: httpx.AsyncClient, api: int) -> None:
        out.append(await ask(http, api, model))

    async with clients(urls, key) as https:
        if rate is None:
            await asyncio.gather(*(closed(a * CLIENTS_PER_PROCESS + c, http, a) for a, http in enumerate(https)
                                   for c in range(CLIENTS_PER_PROCESS)))
            return
        rng, tasks = random.Random(SEED), []
        for i in itertools.count():
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(one(https[i % len(https)], i % len(https))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def make_tenant(db_url: str, name: str, **limits: int) -> str:
    """A key of a new tenant (weight 1, granted `priority`, which the run sends) with
    `limits` on all its models."""
    db = connect(db_url, pool_size=1)
    try:
        async with db.begin() as conn:
            await tenant_store.ensure_tenant(conn, name)
            await tenant_store.set_tiers(conn, name, [Tier.PRIORITY])
            if limits:
                await tenant_store.set_limits(conn, name, "*", **limits)
            return (await tenant_store.create_key(conn, name, "bench"))[1]
    finally:
        await db.dispose()


def window_of(t: float) -> float:
    return t - t % MINUTE


class FoldWatch:
    """How old the reconciler's last fold is, every 0.25 s, by the database's clock
    (now() − quota_fold.folded_at): S counts one fold per refresh period."""

    def __init__(self, db_url: str):
        self.url, self.ages = libpq_url(db_url), list[tuple[float, float]]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.25):
                row = conn.execute("SELECT extract(epoch FROM now() - folded_at)::float8 FROM quota_fold").fetchone()
                if row is not None:
                    self.ages.append((time.time(), row[0]))

    def __enter__(self) -> FoldWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def oldest(self, since: float, until: float) -> float:
        return max((age for at, age in self.ages if since <= at <= until), default=float("nan"))


def settled(db_url: str, tenant: str) -> tuple[int, int]:
    """(reserve rows, of those the subjects settled or refunded): the journaling's progress."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE kind = 'reserve'), count(DISTINCT subject) FILTER (WHERE kind IN "
            "('settle', 'refund')) FROM ledger WHERE tenant = %s", (tenant,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def drained(db_url: str, tenant: str, watch: FoldWatch, refresh_s: float, log: Callable[[str], None],
                  timeout_s: float = 240) -> None:
    """Until every request of `tenant` is journaled and settled and the fold is fresh: the
    next phase starts on a control plane that has caught up."""
    began = time.time()
    while time.time() - began < timeout_s:
        (n, done), age = await asyncio.to_thread(settled, db_url, tenant), (watch.ages or [(0, 0.0)])[-1][1]
        if done >= n and age < 2 * refresh_s:
            log(f"  ({tenant}: {n} requests settled and the fold fresh after {time.time() - began:.0f} s)")
            return
        await asyncio.sleep(1)
    log(f"  ({tenant}: not caught up after {timeout_s:.0f} s: {done} of {n} settled, fold {age:.1f} s old)")


async def phase(name: str, urls: list[str], db_url: str, settings: Settings, watch: FoldWatch, served: float,
                paced: bool, log: Callable[[str], None]) -> dict:
    """Tenant `name` at a limit L of what the load admits in FILL_S, until a minute window
    has filled at least 3 × S before its end and 3 × S more have passed; judged from the
    ledger and the client's record."""
    stale_s = 2 * settings.admission_flush_s + 3 * settings.admission_refresh_s
    rate = served / 2 if paced else None
    limit = max(20, round((rate or served) * FILL_S))
    key = await make_tenant(db_url, name, requests_per_min=limit)
    await asyncio.sleep(2 * settings.admission_refresh_s + 0.5)  # every process has read the limit
    stop, replies = asyncio.Event(), list[Reply]()
    driving = asyncio.create_task(drive(urls, key, settings.model_name, stop, replies, rate))
    started = time.time()
    filled: dict[float, float] = {}  # window → when the client's count of accepted requests reached L
    while True:
        await asyncio.sleep(0.2)
        now = time.time()
        for w, n in Counter(window_of(r.got) for r in replies if r.status == 200).items():
            if n >= limit:
                filled.setdefault(w, now)
        if any(f <= w + MINUTE - 3 * stale_s and now >= f + 3 * stale_s for w, f in filled.items()):
            break
        if now - started > MINUTE + 3 * FILL_S + 3 * stale_s:
            log(f"  {name}: no window filled well inside its minute")
            break
    stop.set()
    await driving
    ended = time.time()
    await asyncio.sleep(2 * settings.admission_flush_s + 1)  # the last reserve rows reach the ledger
    reserved, done = await asyncio.to_thread(settled, db_url, name)
    reserves, refunded, per_minute = await asyncio.to_thread(ledger_rows, db_url, name)
    f = judge(limit, len(urls), stale_s, replies, reserves, refunded, per_minute)
    f = dict(load=f"{rate:.1f} requests/s, open loop" if rate else
             f"{CLIENTS_PER_PROCESS * len(urls)} closed-loop clients", rpm_limit=limit,
             seconds=round(ended - started, 1), **f, within_bound=f["overshoot"] <= f["bound"],
             fold_age_max_s=round(watch.oldest(started, ended), 2), settled_by_the_end=f"{done} of {reserved}")
    log(f"  {name} ({f['load']}), limit {limit} rpm: reserve rows per window (SQL) {f['per_window']}, the client's "
        f"accepted {f['per_window_client']} → worst +{f['overshoot']} ({f['overshoot_pct']}%), bound {f['bound']} "
        f"(peak {f['peak_per_process_in_s']} admissions per process within S = {stale_s} s; {f['holders']} processes "
        f"admitted); staleness the ledger proves {f['proven_staleness_s']} s; the fold's age at most "
        f"{f['fold_age_max_s']} s; settled by the end {f['settled_by_the_end']}; refused {f['refused']}, below quota "
        f"{f['wrongly_refused']} (not judged: {f['refusals_across_a_minute']}); other answers {f['other_answers']}; "
        f"ledger matches the client: {f['ledger_matches_client']}")
    await drained(db_url, name, watch, settings.admission_refresh_s, log)
    return f


async def overshoot(urls: list[str], db_url: str, settings: Settings, log: Callable[[str], None]) -> dict:
    """The rate the stack serves (a tenant without limits, closed loop), then two phases:
    paced at half that rate, and saturating."""
    model = settings.model_name
    probe_key = await make_tenant(db_url, "probe")
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {probe_key}"}) as http:
        for url in urls:  # each process's first requests are slow (connections, tokenizer)
            for _ in range(3):
                r = await http.post(url + "/v1/chat/completions", json=body(model))
                assert r.status_code == 200, r.text
    with FoldWatch(db_url) as watch:
        stop, probe = asyncio.Event(), list[Reply]()
        driving = asyncio.create_task(drive(urls, probe_key, model, stop, probe))
        await asyncio.sleep(PROBE_S)
        stop.set()
        await driving
        served = sum(r.status == 200 for r in probe) / PROBE_S
        log(f"the stack served {served:.1f} requests/s through {len(urls)} API processes (closed loop, "
            f"{CLIENTS_PER_PROCESS * len(urls)} clients)")
        await drained(db_url, "probe", watch, settings.admission_refresh_s, log)
        return dict(served_per_s=round(served, 1),
                    paced=await phase("paced", urls, db_url, settings, watch, served, True, log),
                    saturated=await phase("saturated", urls, db_url, settings, watch, served, False, log))


def ledger_rows(db_url: str, tenant: str) -> tuple[list[tuple[str, str, float]], set[str], dict[float, int]]:
    """Tenant's reserve rows (subject, holder, at) in time order, the subjects refunded,
    and SQL's own count of reserve rows per UTC minute."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        reserves = conn.execute(
            "SELECT subject, holder, extract(epoch FROM at)::float8 FROM ledger WHERE tenant = %s AND kind = 'reserve'"
            " ORDER BY at, position", (tenant,)).fetchall()
        refunded = {r[0] for r in conn.execute(
            "SELECT subject FROM ledger WHERE tenant = %s AND kind = 'refund'", (tenant,)).fetchall()}
        per_minute = conn.execute(
            "SELECT extract(epoch FROM date_trunc('minute', at, 'UTC'))::float8, count(*) FROM ledger"
            " WHERE tenant = %s AND kind = 'reserve' GROUP BY 1 ORDER BY 1", (tenant,)).fetchall()
    return [(s, h, float(a)) for s, h, a in reserves], refunded, {float(w): int(n) for w, n in per_minute}


def most_within(times: list[float], span_s: float) -> int:
    """The most of `times` (sorted) inside any `span_s`-long stretch."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > span_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def proven_staleness(reserves: list[tuple[str, str, float]], limit: int) -> float:
    """The least staleness the ledger proves (see the module doc): over every admission
    made when the window already held n ≥ L reserves, t minus the time of the k-th newest
    reserve by another process before it, k = n − L + 1."""
    worst = 0.0
    by_window: dict[float, list[tuple[str, float]]] = defaultdict(list)
    for _, holder, at in reserves:
        by_window[window_of(at)].append((holder, at))
    for rows in by_window.values():
        for i, (holder, at) in enumerate(rows):
            if i - limit + 1 < 1:  # the window held fewer than L before it
                continue
            before = [(h, a) for h, a in rows[:i] if a < at]
            k = len(before) - limit + 1
            if k < 1:
                continue
            others = [a for h, a in before if h != holder]
            # p's own count is exact, so k of the others' reserves before t were not in its view
            if len(others) >= k:
                worst = max(worst, at - others[-k])
    return worst


def judge(limit: int, processes: int, stale_s: float, replies: list[Reply],
          reserves: list[tuple[str, str, float]], refunded: set[str], per_minute: dict[float, int]) -> dict:
    """The figures, from SQL over the ledger and the client's record only."""
    accepted = {f"request:{r.id}" for r in replies if r.status == 200}
    reserved = {s for s, _, _ in reserves}
    window_at = {s: window_of(at) for s, _, at in reserves}
    client_per_window = Counter(window_at.get(s, -1.0) for s in accepted)
    times = sorted(at for _, _, at in reserves)
    in_window: dict[float, list[float]] = defaultdict(list)
    for at in times:
        in_window[window_of(at)].append(at)
    wrong = ambiguous = 0
    for r in replies:
        if r.status != 429 or r.code != "rate_limit_exceeded":
            continue
        w = window_of(r.sent)
        if window_of(r.got) != w:
            ambiguous += 1
        elif bisect.bisect_right(in_window[w], r.got) + 1 <= limit:
            wrong += 1  # answered while the ledger shows room: refused below quota
    by_holder: dict[str, list[float]] = defaultdict(list)
    for _, holder, at in reserves:
        by_holder[holder].append(at)
    peak = max((most_within(ts, stale_s) for ts in by_holder.values()), default=0)
    worst = max((n - limit for n in per_minute.values()), default=0)
    bound = (processes - 1) * min(limit, peak)  # the documented bound, by hand
    statuses = Counter(r.status for r in replies)
    return dict(
        windows=len(per_minute), per_window=list(per_minute.values()),
        per_window_client=[client_per_window[w] for w in per_minute],
        filled=any(n >= limit for n in per_minute.values()),
        admitted=len(reserves), accepted_by_client=len(accepted), refused=statuses[429],
        other_answers={str(s): n for s, n in sorted(statuses.items()) if s not in (200, 429)},
        overshoot=max(0, worst), overshoot_pct=round(100 * max(0, worst) / limit, 2), bound=bound,
        peak_per_process_in_s=peak, proven_staleness_s=round(proven_staleness(reserves, limit), 3),
        wrongly_refused=wrong, refusals_across_a_minute=ambiguous,
        ledger_matches_client=accepted == reserved - refunded and not (accepted & refunded),
        refunded=len(refunded), holders=len(by_holder),
    )


def across_processes(settings: Settings, log: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-admission-") as d, \
            ballast_up(settings, Path(d)) as st, more_apis(st.pid, PROCESSES - 1, Path(d) / "logs") as others:
        urls = [str(st.api.base_url).rstrip("/"), *others]
        over = asyncio.run(overshoot(urls, owner_url(st.db_url, Path(d)), settings, log))
    return dict(processes=len(urls), clients=CLIENTS_PER_PROCESS * len(urls),
                staleness_s=2 * settings.admission_flush_s + 3 * settings.admission_refresh_s, **over)


def main(settings: Settings, log: Callable[[str], None] = print) -> int:
    cost = decision_costs(settings)
    log(f"decision cost, local (memory only): p50 {cost['local_p50_us']} µs, p99 {cost['local_p99_us']} µs "
        f"({LOCAL_DECISIONS} decisions)")
    log(f"decision cost, sync (one transaction): p50 {cost['sync_p50_us']} µs, p99 {cost['sync_p99_us']} µs "
        f"({SYNC_DECISIONS} decisions): {cost['sync_over_local_p50']}× local at p50, "
        f"{cost['sync_over_local_p99']}× at p99")
    log(f"overshoot across {PROCESSES} API processes of one `ballast up`:")
    f = dict(**cost, **across_processes(settings, log))
    print(json.dumps(f))
    ok = all(p["within_bound"] and p["wrongly_refused"] == 0 and p["ledger_matches_client"] and p["filled"]
             and p["holders"] == f["processes"] and p["proven_staleness_s"] <= f["staleness_s"]
             for p in (f["paced"], f["saturated"]))
    return 0 if ok else 1
