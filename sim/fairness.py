"""Tenants' fair shares under contention: one heavy tenant floods a pool past its capacity
while a few light tenants send at a modest rate, all in the same tier; the engines' queues
served by the Virtual Token Counter (`fair_share="vtc"`, the engine worker's default)
against arrival order (`"fcfs"`), on the same trace, in one run.

The trace: each tenant's requests are Poisson at its own rate; a prompt is the tenant's
system prompt (lognormal, median 1,500 tokens, fixed per tenant) and a lognormal user turn
(median 80); outputs lognormal (median 120, σ 0.9, ≤ 2,048), as sim/trace.py's chats. The
heavy tenant sends `overload` × what the pool serves (about `capacity_per_engine` requests
a second an engine, from the step-time curve), so its backlog grows for the whole run.

Service is counted as the VTC counts it (input + 2 × output tokens) up to the last arrival:
a request's prompt once its first token is out, its output pro rata between its first
token and its end (decoding is steady while the pool is full). After the last arrival the
backlog drains, which would make every tenant's total its demand.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from protocol.tiers import Tier
from sim.engine import EngineSpec, Job
from sim.loop import FleetSpec, RunSpec, pct, run
from sim.trace import Arrival, chain, lognormal

ARMS = ("vtc", "fcfs")
HEAVY = 0  # the heavy tenant's id; light tenants are 1…


@dataclass(frozen=True)
class FairnessSetup:
    engines: int = 4
    seconds: float = 60.0
    seed: int = 1
    light_tenants: int = 4
    light_rate: float = 1.0  # requests a second, each light tenant (pool-wide)
    overload: float = 1.5  # the heavy tenant's rate over the pool's capacity
    capacity_per_engine: float = 17.0  # requests a second at 64 slots, ~180 output tokens a request, 21 ms a step

    @property
    def heavy_rate(self) -> float:
        return self.overload * self.capacity_per_engine * self.engines


@dataclass(frozen=True)
class TenantStats:
    tenant: int
    requests: int
    ttft: tuple[float, float]  # p50, p99 (s)
    served: float  # VTC units (input + 2 × output tokens) by the last arrival
    demand: float  # VTC units of its requests (all of them arrive by then)
    share: float  # of all tenants' served


@dataclass(frozen=True)
class FairnessArm:
    arm: str
    tenants: tuple[TenantStats, ...]  # heavy first
    cpu_s: float


@dataclass(frozen=True)
class FairnessResult:
    setup: FairnessSetup
    arms: tuple[FairnessArm, ...]  # in ARMS order
    until: float  # the last arrival


def arrivals(setup: FairnessSetup) -> Iterator[Arrival]:
    rng = random.Random(setup.seed)
    tenants = 1 + setup.light_tenants
    rates = [setup.heavy_rate] + [setup.light_rate] * setup.light_tenants
    system = [lognormal(rng, 1500, 0.6, 128, 8192) for _ in range(tenants)]
    total = sum(rates)
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(total)
        if t >= setup.seconds:
            return
        tenant = rng.choices(range(tenants), weights=rates)[0]
        prompt = system[tenant] + lognormal(rng, 80, 0.8, 1, 8192)
        blocks = chain((), prompt // 128, (1, tenant), system[tenant] // 128, n)
        yield Arrival(n, t, tenant, Tier.DEFAULT, 0, 0, prompt, lognormal(rng, 120, 0.9, 1, 2048), blocks)
        n += 1


def served_by(job: Job, until: float) -> float:
    """What `job` got by `until`, in VTC units (see the module's docstring)."""
    a = job.arrival
    assert job.first is not None and job.finished is not None
    if job.first > until:
        return 0.0
    span = job.finished - job.first
    done = 1.0 if span <= 0 else min(1.0, (until - job.first) / span)
    return a.prompt + 2 * (1 + (a.output - 1) * done)


def experiment(setup: FairnessSetup = FairnessSetup()) -> FairnessResult:
    trace = list(arrivals(setup))
    until = trace[-1].at if trace else 0.0
    out = []
    for arm in ARMS:
        fleet = FleetSpec(engines_per_pool=setup.engines, engine=EngineSpec(fair_share=arm))
        o = run(fleet, trace, RunSpec("affinity", keep_jobs=True))
        by: dict[int, list[Job]] = {}
        for j in o.jobs:
            by.setdefault(j.arrival.tenant, []).append(j)
        served = {t: sum(served_by(j, until) for j in jobs) for t, jobs in by.items()}
        whole = max(1e-9, sum(served.values()))
        rows = []
        for t in sorted(by):
            ttft = array("d", sorted(j.first - j.arrival.at for j in by[t] if j.first is not None))
            demand = sum(j.arrival.prompt + 2 * j.arrival.output for j in by[t])
            rows.append(TenantStats(t, len(by[t]), (pct(ttft, 50), pct(ttft, 99)), served[t], demand,
                                    served[t] / whole))
        out.append(FairnessArm(arm, tuple(rows), o.cpu_s))
    return FairnessResult(setup, tuple(out), until)
