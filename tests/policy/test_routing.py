"""Routing weights across cells (policy/routing.py), worked by hand."""

from __future__ import annotations

from policy.routing import CellCapacity, weights


def test_routing_weights_follow_capacity_and_drop_a_cell_out_of_reach():
    got = weights([CellCapacity("eu", True, 16, 0), CellCapacity("us", True, 16, 16), CellCapacity("ap", False, 16),
                   CellCapacity("sa", True, 0)])
    # eu: 16 free of 16; us: all 16 busy, counted at half (8); ap out of reach; sa has no engine.
    assert got == {"ap": 0, "eu": 256, "sa": 0, "us": 128}
    assert weights([CellCapacity("eu", False)]) == {"eu": 0}
