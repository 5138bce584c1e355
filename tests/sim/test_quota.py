from protocol.tiers import Tier
from sim.quota import QuotaSetup, rtt, simulate


def test_round_trips_grow_with_ring_distance():
    assert rtt(0, 0, 30, 0.005, 0.15) == 0.005
    assert rtt(0, 15, 30, 0.005, 0.15) == rtt(15, 0, 30, 0.005, 0.15) == 0.155
    assert rtt(0, 29, 30, 0.005, 0.15) == rtt(0, 1, 30, 0.005, 0.15)


def test_synchronous_never_overshoots_and_pays_a_round_trip():
    sync, _ = simulate(QuotaSetup(regions=10, minutes=3, tier=Tier.PRIORITY)).modes
    assert sync.overshoot == 0 and 0.99 < sync.admitted_share <= 1.0
    assert 0.005 <= sync.added_p50_s <= sync.added_p99_s <= 0.155


def test_staleness_overshoots_within_what_the_others_admit_unseen():
    shares = []
    for period in (0.1, 1.0, 5.0):
        s = QuotaSetup(regions=10, minutes=3, tier=Tier.PRIORITY, reconcile_s=period)
        _, stale = simulate(s).modes
        # The others admit at most their offered rate over the staleness (period + a round trip) unseen.
        blind = s.demand * (period + s.rtt_floor_s + s.rtt_span_s) / 60
        assert stale.overshoot <= 2 * blind
        assert stale.added_p99_s == 0 and stale.messages_per_s == 2 * s.regions / period
        shares.append(stale.admitted_share)
    assert shares == sorted(shares) and shares[-1] > 1.0


def test_one_region_sees_itself_exactly():
    _, stale = simulate(QuotaSetup(regions=1, minutes=2, tier=Tier.PRIORITY, reconcile_s=5.0)).modes
    assert stale.overshoot == 0
