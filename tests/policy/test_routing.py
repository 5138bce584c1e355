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


def test_a_key_keeps_its_home_while_that_cell_holds_it_and_is_given_one_that_does_otherwise():
    import hashlib

    from policy.routing import homes

    def ranked_first(key: str, cells: list[str]) -> str:  # rendezvous hashing, as documented
        return max(cells, key=lambda c: hashlib.sha256(f"{key}/{c}".encode()).digest())

    held = {"k1": ["eu"], "k2": ["eu", "us", "ap"], "k3": ["us", "ap"], "k4": []}
    fresh = homes(held, {})
    assert fresh == {"k1": "eu", "k2": ranked_first("k2", ["eu", "us", "ap"]), "k3": ranked_first("k3", ["us", "ap"])}
    assert homes(held, {}) == fresh  # any reconciler, any restart: the same homes
    # A home already set stays while its cell holds the key (a cell added ranks no key away).
    assert homes({**held, "k2": ["eu", "us", "ap", "sa"]}, {"k2": "us"})["k2"] == "us"
    # Its cell no longer holds it (revoked there): another that does.
    assert homes({"k2": ["eu", "ap"]}, {"k2": "us"}) == {"k2": ranked_first("k2", ["eu", "ap"])}
    # A key gone everywhere has no home; one the map held that no cell holds is dropped.
    assert homes({"k4": []}, {"k4": "eu", "k9": "us"}) == {}
