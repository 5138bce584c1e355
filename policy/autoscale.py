"""How many engines a pool wants now: the autoscaling signal the control worker exports
(`ballast_engines_wanted`), for KEDA or an HPA to act on. Pure: the load is passed in.

1. Interactive: the pool's peak interactive requests in flight, each engine kept at
   `target_busy` of its slots.
2. Batch: the tokens queued for the pool, drained within `drain_s` at the batch throughput
   one of its engines has shown (tokens a second, measured over the last readings);
   nothing measured yet but something queued: one engine.
3. Their sum, at least `min_engines` and at most `max_engines`. Interactive and batch
   share engines, batch taking what interactive leaves, so the sum is what both need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolLoad:
    engines: int  # live now
    slots: int  # sequence slots of one engine (max_num_seqs)
    interactive: int  # peak interactive requests in flight, over the pool
    queued_tokens: int  # tokens its open batch work still holds
    tokens_per_s: float | None  # batch tokens generated per second by the pool lately (None: not measured)


@dataclass(frozen=True)
class ScalePolicy:
    target_busy: float = 0.7
    drain_s: float = 3600.0
    min_engines: int = 1
    max_engines: int = 64


def engines_wanted(load: PoolLoad, policy: ScalePolicy) -> int:
    # 1. Interactive.
    interactive = math.ceil(load.interactive / max(1.0, load.slots * policy.target_busy))
    # 2. Batch, at one engine's measured pace.
    per_engine = (load.tokens_per_s / load.engines) if load.tokens_per_s and load.engines else 0.0
    if load.queued_tokens <= 0:
        batch = 0
    elif per_engine > 0:
        batch = math.ceil(load.queued_tokens / (per_engine * policy.drain_s))
    else:
        batch = 1
    # 3. Bounded.
    return max(policy.min_engines, min(policy.max_engines, interactive + batch))
