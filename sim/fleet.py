"""The fleet at the seeds' scale: many regions, thousands of engines, a million requests a
minute, every class, bursts, and a region lost halfway.

A region holds `engines_per_region` engines in pools of `pool_size` (one model each);
each tenant's requests come from its home region for its model. The trace's diurnal curve
runs over a real day, so a run of minutes sits at its mean; bursts raise the rate 1.5× for
5 s about every 30 s. Region 0 vanishes at `lose_at` of the run (None: no loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.engine import EngineSpec
from sim.loop import FleetSpec, Outcome, RunSpec, run
from sim.trace import TraceSpec, arrivals


@dataclass(frozen=True)
class FleetSetup:
    regions: int = 30
    engines_per_region: int = 64
    pool_size: int = 16
    minutes: float = 1.0
    rate_per_min: float = 1_000_000.0
    seed: int = 1
    tenants_per_region: int = 100
    lose_at: float | None = 0.5  # of the run
    arm: str = "affinity"

    def trace(self) -> TraceSpec:
        return TraceSpec(seconds=60 * self.minutes, rate_per_s=self.rate_per_min / 60, seed=self.seed,
                         regions=self.regions, models=self.models, tenants=self.tenants_per_region,
                         conversations=20 * self.tenants_per_region * self.regions,
                         burst_every_s=30.0, burst_s=5.0, burst_factor=1.5)

    @property
    def models(self) -> int:
        return max(1, self.engines_per_region // self.pool_size)

    def fleet(self) -> FleetSpec:
        return FleetSpec(self.regions, self.models, self.pool_size, EngineSpec())


def simulate(setup: FleetSetup = FleetSetup()) -> Outcome:
    lose = setup.lose_at is not None and setup.regions > 1
    spec = RunSpec(setup.arm, sample_s=1.0, lose_region=0 if lose else None,
                   lose_at=60 * setup.minutes * (setup.lose_at or 0.0) if lose else float("inf"))
    return run(setup.fleet(), arrivals(setup.trace()), spec)
