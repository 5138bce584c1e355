"""Reservations in output tokens a second, held as sequence slots: checked against slot
counts worked by hand from the engines' stated rates."""

from __future__ import annotations

from policy.reservations import Peer, Reserved, in_slots, shares, slots_for


def test_tokens_a_second_are_the_slots_that_give_them_with_every_slot_busy():
    # Two engines of 8 slots generating 200 and 120 tokens a second when busy: 320 over 16
    # slots, 20 a slot at full load. 100 tokens a second → 5 slots; 101 → 6 (never fewer).
    pool = [Peer("eu", 8, 200.0), Peer("eu", 8, 120.0)]
    assert [slots_for(t, pool) for t in (100, 101, 20, 1)] == [5, 6, 1, 1]
    # More than the pool gives: every slot, no more.
    assert slots_for(10_000, pool) == 16
    # An engine that has not run full yet counts for slots, not for the rate: still 5.
    assert slots_for(100, [*pool, Peer("eu", 8, 0.0)]) == 5
    # Nothing measured yet: one slot, so the tenant's first request starts at once.
    assert slots_for(500, [Peer("eu", 8, 0.0)]) == 1
    # Spare sequences share the rate too: 20 a slot becomes 16 over 8 slots and 2 spares
    # (2 × 10 sequences), so 100 tokens a second need 7 slots, not 5.
    assert slots_for(100, [Peer("eu", 8, 160.0, spare=2), Peer("eu", 8, 160.0, spare=2)]) == 7
    # No reservation, or no engine: none.
    assert slots_for(0, pool) == 0 and slots_for(100, []) == 0


def test_in_slots_converts_only_tokens_reservations_each_over_its_own_region():
    peers = {"e1": Peer("eu", 4, 80.0), "e2": Peer("eu", 4, 80.0), "e3": Peer("us", 4, 40.0)}
    pool = [Reserved("gold", 0, "eu", tokens_per_s=50), Reserved("gold", 0, "", tokens_per_s=50),
            Reserved("tin", 3)]
    # eu: 160 over 8 slots, 20 a slot → 3; anywhere: 200 over 12, 16.7 a slot → 3; tin as set.
    assert [(r.tenant, r.slots, r.region) for r in in_slots(pool, peers)] == [
        ("gold", 3, "eu"), ("gold", 3, ""), ("tin", 3, "")]
    # A region with no engine keeps nothing.
    assert in_slots([Reserved("gold", 0, "ap", tokens_per_s=50)], peers)[0].slots == 0
    # Then split over the engines as reservations in slots are: e1 2 (eu) + 1 (anywhere).
    regions = {e: p.region for e, p in peers.items()}
    assert [shares(in_slots(pool, peers), regions, e) for e in ("e1", "e2", "e3")] == [
        {"gold": 2 + 1, "tin": 1}, {"gold": 1 + 1, "tin": 1}, {"gold": 1, "tin": 1}]
