"""The autoscaling signal's arithmetic, case by case, worked out by hand."""

from __future__ import annotations

import pytest

from policy.autoscale import PoolLoad, ScalePolicy, engines_wanted

P = ScalePolicy(target_busy=0.5, drain_s=1000, min_engines=1, max_engines=10)


@pytest.mark.parametrize("load, want", [
    (PoolLoad(engines=1, slots=8, interactive=0, queued_tokens=0, tokens_per_s=None), 1),  # idle: the floor
    (PoolLoad(engines=1, slots=8, interactive=9, queued_tokens=0, tokens_per_s=None), 3),  # 9 / (8 × 0.5) → 3
    (PoolLoad(engines=2, slots=8, interactive=0, queued_tokens=50_000, tokens_per_s=20.0), 5),  # 50k / (10 × 1000)
    (PoolLoad(engines=2, slots=8, interactive=4, queued_tokens=50_000, tokens_per_s=20.0), 6),  # 1 + 5
    (PoolLoad(engines=0, slots=8, interactive=0, queued_tokens=10, tokens_per_s=None), 1),  # unmeasured: one
    (PoolLoad(engines=1, slots=8, interactive=400, queued_tokens=0, tokens_per_s=None), 10),  # the ceiling
])
def test_engines_wanted(load, want):
    assert engines_wanted(load, P) == want


def test_no_floor_lets_an_idle_pool_scale_to_zero():
    idle = PoolLoad(engines=1, slots=8, interactive=0, queued_tokens=0, tokens_per_s=0.0)
    assert engines_wanted(idle, ScalePolicy(min_engines=0)) == 0
