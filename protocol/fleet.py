"""What the fleet controller carries between ticks and reads from engine workers: shapes
that cross Temporal's history (its workflow input, its activities' results)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineReport:
    """What an engine worker last reported (every second, off the request path)."""

    id: str
    pool: str  # the model it serves: the engines of a pool are interchangeable
    max_seqs: int
    interactive: int  # the most interactive requests in flight at once over its last few reports
    batch: int  # batch generations holding slots
    running: int  # vLLM's running sequences
    waiting: int  # requests queued inside vLLM
    kv_cache_usage: float  # 0..1
    fleet_cap: int | None = None  # the batch cap the controller set on it, if any
    batch_queued: int = 0  # batch generations waiting on it for a slot


@dataclass(frozen=True)
class SurgePolicy:
    high: float = 0.8
    low: float = 0.5
    cool_down_s: float = 10.0
    batch_share: float = 0.0  # of each engine's slots, kept by batch during a surge


@dataclass(frozen=True)
class Surge:
    """A pool's surge state between ticks."""

    surging: bool = False
    since: float | None = None  # when the surge began
    calm_since: float | None = None  # surging, but pressure under `low` since
