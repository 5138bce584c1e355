"""Routing weights across cells (policy/routing.py), worked by hand."""

from __future__ import annotations

from policy.routing import CellCapacity, weights


def test_routing_weights_follow_capacity_and_drop_a_cell_out_of_reach():
    got = weights([CellCapacity("eu", True, 16, 0), CellCapacity("us", True, 16, 16), CellCapacity("ap", False, 16),
                   CellCapacity("sa", True, 0)])
    # eu: 16 free of 16; us: all 16 busy, counted at half (8); ap out of reach; sa has no engine.
    assert got == {"ap": 0, "eu": 256, "sa": 0, "us": 128}
    assert weights([CellCapacity("eu", False)]) == {"eu": 0}


def test_a_fenced_key_goes_to_the_heaviest_of_its_regions_and_never_outside():
    from policy.routing import fenced

    w = {"eu": 100, "us": 256, "ap": 0, "sa": 256}
    assert fenced({"k1": ["eu", "us"], "k2": ["ap"], "k3": ["mars"], "k4": ["sa", "us"], "k5": ["eu", "ap"]}, w) == {
        "k1": "us", "k2": "ap", "k3": "", "k4": "sa", "k5": "eu"}
