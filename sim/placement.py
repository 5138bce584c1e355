"""Placement at scale: prompt-cache affinity under its load bound against least-loaded and
round-robin, on the same pool and the same trace, in one run.

The pool: `engines` engines of one model in one region. The trace: interactive chats only
(the default tier), at a steady rate, prefix-heavy as `bench/placement.py`'s: tenants'
system prompts and multi-turn conversations that resend their history, with many more
distinct prefix blocks than one engine's cache holds (`cache_blocks`, a quarter of the
default engine's), so that which engine a prefix goes to decides whether it hits.

The target: affinity's hit rate at least twice round-robin's, with load imbalance (max
over mean in flight per engine, time-averaged; sim/loop.py) at most 1.25.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.tiers import Tier
from sim.engine import EngineSpec
from sim.loop import ARMS, FleetSpec, Outcome, RunSpec, run
from sim.trace import TraceSpec, arrivals

HIT_RATIO = 2.0  # affinity's hit rate over round-robin's, at least
MAX_IMBALANCE = 1.25


@dataclass(frozen=True)
class PlacementSetup:
    engines: int = 16
    seconds: float = 120.0
    seed: int = 1
    rate_per_engine: float = 7.5  # chats a second: a quarter to a half of the slots busy, by arm
    tenants: int = 400
    cache_blocks: int = 512  # 64k tokens an engine

    def trace(self) -> TraceSpec:
        return TraceSpec(seconds=self.seconds, rate_per_s=self.rate_per_engine * self.engines, seed=self.seed,
                         tenants=self.tenants, mix=((Tier.DEFAULT, 1.0),), diurnal=0.0)

    def fleet(self) -> FleetSpec:
        return FleetSpec(engines_per_pool=self.engines, engine=EngineSpec(cache_blocks=self.cache_blocks))


@dataclass(frozen=True)
class PlacementResult:
    setup: PlacementSetup
    outcomes: tuple[Outcome, ...]  # in ARMS order
    distinct_blocks: int  # prefix blocks in the whole trace

    def arm(self, name: str) -> Outcome:
        return next(o for o in self.outcomes if o.arm == name)

    @property
    def hit_ratio(self) -> float:
        return self.arm("affinity").hit_rate / max(1e-9, self.arm("round_robin").hit_rate)

    @property
    def met(self) -> bool:
        return self.hit_ratio >= HIT_RATIO and self.arm("affinity").imbalance <= MAX_IMBALANCE


def experiment(setup: PlacementSetup = PlacementSetup()) -> PlacementResult:
    distinct = len({b for a in arrivals(setup.trace()) for b in a.blocks})
    outcomes = tuple(run(setup.fleet(), arrivals(setup.trace()), RunSpec(arm)) for arm in ARMS)
    return PlacementResult(setup, outcomes, distinct)
