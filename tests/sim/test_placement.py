from sim.placement import HIT_RATIO, MAX_IMBALANCE, PlacementSetup, experiment


def test_affinity_doubles_round_robin_s_hits_within_the_load_bound():
    # 16 engines, 40 s of prefix-heavy chat: far more prefix blocks than one engine holds.
    r = experiment(PlacementSetup(engines=16, seconds=40, seed=2))
    assert r.distinct_blocks > 10 * r.setup.cache_blocks
    assert r.arm("affinity").hit_rate >= HIT_RATIO * r.arm("round_robin").hit_rate
    assert r.arm("affinity").imbalance <= MAX_IMBALANCE
    assert r.met
    # Same trace in every arm.
    assert len({o.requests for o in r.outcomes}) == 1
