"""A trace played over a fleet in virtual time: the event loop and the placement arms.

The fleet: `regions` × `models` pools of `engines_per_pool` engines (a pool: one model's
engines in one region). A request is placed within its home region's pool for its model,
as the region's API places it (`policy.placement.rank` over that pool, with the API's
`policy.prefix.PrefixIndex`); ranking the whole fleet per request is what the real system
never does. The arms, as `api/services/placer.py` builds them:
- affinity: `rank` with the default `Weights` (prefix affinity under the load bound);
- least_loaded: `rank` with no affinity weight (load alone);
- round_robin: the pool's engines by id, in turn.

A lost region's engines vanish with what they held; its requests in flight are placed
again from scratch, and its traffic from then on goes to the live regions, each tenant's
to one of them (by tenant id, so the load spreads evenly and a tenant's prefixes stay
together), placed there by that region's API: an assumption, as the geography a tenant
allows is a setting.

Events are ordered by (time, sequence number): engine events scheduled before an arrival
at the same instant go first. Imbalance is sampled every `sample_s` per pool: max over
mean of the requests in flight (running and waiting) per engine, at the moments with at
least one per engine in flight (fewer cannot be balanced), as `bench/placement.py`
measures it on real engines.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from policy.placement import EngineView, Request, Weights, rank
from policy.preemption import pool_step
from policy.prefix import PrefixIndex
from protocol.fleet import Surge, SurgePolicy
from sim.engine import Engine, EngineSpec, Job
from sim.trace import Arrival

ARMS = ("affinity", "least_loaded", "round_robin")


@dataclass(frozen=True)
class FleetSpec:
    regions: int = 1
    models: int = 1  # pools per region
    engines_per_pool: int = 16
    engine: EngineSpec = EngineSpec()
    # A replay's: the real engines' ids (the placer's tie-break hashes them) and the real
    # API's prefix index size. Defaults: made-up ids, an index the size of the pool's caches.
    engine_ids: tuple[str, ...] = ()
    index_blocks: int = 0


@dataclass(frozen=True)
class RunSpec:
    arm: str = "affinity"
    weights: Weights = Weights()
    sample_s: float = 0.1
    tick_s: float = 1.0  # the fleet controller's (config/scheduling.py's fleet_tick_s)
    surge: SurgePolicy = SurgePolicy()
    lose_region: int | None = None
    lose_at: float = math.inf
    keep_jobs: bool = False  # hand back every finished job (tests)


@dataclass(frozen=True)
class ClassStats:
    tier: str
    requests: int
    ttft: tuple[float, float]  # p50, p99 (seconds, from arrival)
    e2e: tuple[float, float]
    hit_rate: float  # cached over looked-up prompt tokens
    preempted: int  # preemptions its jobs suffered


@dataclass(frozen=True)
class Outcome:
    arm: str
    requests: int
    simulated_s: float  # the virtual time of the last event
    wall_s: float
    cpu_s: float  # this process's CPU time for the run (on a shared machine, steadier than wall time)
    classes: tuple[ClassStats, ...]
    hit_rate: float
    utilization: float  # mean over engines of busy slots over all slots, over the run
    busy: float  # mean share of time an engine had anything running
    imbalance: float
    replaced: int  # requests placed again after their engine vanished
    surges: int  # pools that entered a surge, counted each time
    engines: int
    jobs: tuple[Job, ...] = field(default=(), repr=False)


class Pool:
    def __init__(self, name: str, engines: list[Engine], index_blocks: int):
        self.name = name
        self.engines = sorted(engines, key=lambda e: e.id)
        self.index = PrefixIndex(index_blocks)
        self.turn = 0
        self.surge = Surge()


def build(fleet: FleetSpec) -> dict[tuple[int, int], Pool]:
    s, n = fleet.engine, fleet.engines_per_pool
    assert not fleet.engine_ids or (len(fleet.engine_ids) == n and fleet.regions * fleet.models == 1)

    def name(r: int, m: int, i: int) -> str:
        return fleet.engine_ids[i] if fleet.engine_ids else f"r{r:02d}-m{m}-e{i:03d}"

    return {(r, m): Pool(f"r{r:02d}-m{m}", [Engine(name(r, m, i), s, f"r{r:02d}", f"m{m}") for i in range(n)],
                         fleet.index_blocks or n * s.cache_blocks)  # the router's index: about the pool's blocks
            for r in range(fleet.regions) for m in range(fleet.models)}


def pick(views: list[EngineView], blocks: tuple[int, ...], index: PrefixIndex, arm: str, w: Weights, turn: int,
         home: str = "") -> tuple[str, int]:
    """The engine the arm sends a request with `blocks` to (the first of the policy's
    ranking; `views` in id order), and round-robin's turn after it."""
    if arm == "round_robin":
        turn = (turn + 1) % len(views)
        return views[turn].id, turn
    weights = w if arm == "affinity" else Weights(0.0, w.load, w.load_bound, w.reserved)
    matched = index.matched(blocks) if arm == "affinity" else {}
    return rank(views, Request(views[0].model, blocks, home=home), matched, weights)[0].id, turn


def choose(pool: Pool, a: Arrival, region: str, arm: str, w: Weights) -> Engine:
    """The engine the arm sends `a` to."""
    best, pool.turn = pick([e.view() for e in pool.engines], a.blocks, pool.index, arm, w, pool.turn, region)
    return next(e for e in pool.engines if e.id == best)


def run(fleet: FleetSpec, trace: Iterable[Arrival], spec: RunSpec = RunSpec()) -> Outcome:
    started, cpu = time.perf_counter(), time.process_time()
    pools = build(fleet)
    engines = [e for p in pools.values() for e in p.engines]
    heap: list[tuple[float, int, int, Engine]] = []
    order = itertools.count()
    lost: set[int] = set()
    stats = _Stats(spec.keep_jobs)
    ratios: list[float] = []

    def schedule(e: Engine) -> None:
        due = e.next_at()
        if due is not None:
            heapq.heappush(heap, (due, next(order), e.version, e))

    def place(job: Job, t: float) -> None:
        a = job.arrival
        region = a.region
        if region in lost:
            live = [r for r in range(fleet.regions) if r not in lost]
            region = live[a.tenant % len(live)]
        pool = pools[(region, a.model)]
        e = choose(pool, a, f"r{region:02d}", spec.arm, spec.weights)
        pool.index.record(e.id, a.blocks)
        e.offer(job, t)
        schedule(e)

    it = iter(trace)
    nxt = next(it, None)
    lose_at = spec.lose_at if spec.lose_region is not None else math.inf
    next_sample, next_tick, last_arrival = 0.0, spec.tick_s, 0.0
    while True:
        t_event = heap[0][0] if heap else math.inf
        t_arrival = nxt.at if nxt is not None else math.inf
        now = min(t_event, t_arrival, lose_at)
        if now == math.inf:
            if not any(p.surge.surging and p.engines[0].up for p in pools.values()):
                break
            now = next_tick  # nothing moves until the controller ends the surge

        while next_sample <= min(now, last_arrival):  # 1. imbalance, while requests arrive
            ratios.extend(_imbalance(p) for p in pools.values() if p.engines[0].up)
            next_sample += spec.sample_s
        if next_tick <= now:  # 2. the fleet controller's tick, while any work is left
            for p in pools.values():
                if p.engines[0].up:
                    versions = [e.version for e in p.engines]
                    stats.surges += _surge(p, next_tick, spec.surge)
                    for e, v in zip(p.engines, versions, strict=True):
                        if e.version != v:
                            schedule(e)
            next_tick += spec.tick_s
            continue
        if lose_at <= now and spec.lose_region is not None:  # 3. a region vanishes
            lost.add(spec.lose_region)
            lose_at = math.inf
            for m in range(fleet.models):
                for e in pools[(spec.lose_region, m)].engines:
                    for job in e.drop(now):
                        stats.replaced += 1
                        place(job, now)
        elif t_event <= t_arrival:  # 4. an engine's marks or wake-up
            _, _, version, e = heapq.heappop(heap)
            if version == e.version and e.up:
                for job in e.fire(now):
                    stats.add(job)
                schedule(e)
        else:  # 5. an arrival
            assert nxt is not None
            place(Job(nxt, now), now)
            last_arrival = now
            nxt = next(it, None)
    horizon = max((e.at for e in engines), default=0.0)
    for e in engines:
        if e.up:
            e.advance(horizon)
    return stats.outcome(spec.arm, engines, horizon, time.perf_counter() - started, time.process_time() - cpu,
                         [r for r in ratios if r > 0])


def _surge(pool: Pool, now: float, policy: SurgePolicy) -> int:
    """The controller's step for one pool (policy.preemption.pool_step): 1 where a surge began."""
    d = pool_step(pool.name, [e.report(pool.name) for e in pool.engines], pool.surge, now, policy)
    pool.surge = d.state
    caps = dict(d.caps)
    for e in pool.engines:
        e.surge_cap(caps[e.id], now)
    return int(d.started)


def _imbalance(pool: Pool) -> float:
    counts = [e.inflight for e in pool.engines]
    total = sum(counts)
    return max(counts) * len(counts) / total if total >= len(counts) else 0.0


def pct(xs: array[float], p: float) -> float:
    """The nearest-rank percentile of sorted `xs`."""
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))] if xs else math.nan


class _Stats:
    def __init__(self, keep: bool):
        self.ttft: dict[str, array[float]] = {}
        self.e2e: dict[str, array[float]] = {}
        self.tokens: dict[str, list[int]] = {}  # queried, cached, preempted
        self.replaced = 0
        self.surges = 0
        self.jobs: list[Job] | None = [] if keep else None

    def add(self, job: Job) -> None:
        a = job.arrival
        assert job.first is not None and job.finished is not None
        if a.tier not in self.ttft:
            self.ttft[a.tier], self.e2e[a.tier], self.tokens[a.tier] = array("d"), array("d"), [0, 0, 0]
        self.ttft[a.tier].append(job.first - a.at)
        self.e2e[a.tier].append(job.finished - a.at)
        tokens = self.tokens[a.tier]
        tokens[0] += job.queried
        tokens[1] += job.cached
        tokens[2] += job.preempted
        if self.jobs is not None:
            self.jobs.append(job)

    def outcome(self, arm: str, engines: list[Engine], horizon: float, wall_s: float, cpu_s: float,
                ratios: list[float]) -> Outcome:
        classes = []
        for tier in sorted(self.ttft):
            ttft, e2e = array("d", sorted(self.ttft[tier])), array("d", sorted(self.e2e[tier]))
            queried, cached, preempted = self.tokens[tier]
            classes.append(ClassStats(tier, len(ttft), (pct(ttft, 50), pct(ttft, 99)), (pct(e2e, 50), pct(e2e, 99)),
                                      cached / max(1, queried), preempted))
        queried = sum(t[0] for t in self.tokens.values())
        cached = sum(t[1] for t in self.tokens.values())
        span = max(horizon, 1e-9)
        return Outcome(
            arm, sum(c.requests for c in classes), horizon, wall_s, cpu_s, tuple(classes), cached / max(1, queried),
            sum(e.seq_time / (e.spec.max_seqs * span) for e in engines) / max(1, len(engines)),
            sum(e.busy_s / span for e in engines) / max(1, len(engines)),
            sum(ratios) / len(ratios) if ratios else 1.0, self.replaced, self.surges, len(engines),
            tuple(self.jobs) if self.jobs is not None else ())
