import dataclasses
import itertools
import statistics

from protocol.tiers import Tier
from sim.trace import TraceSpec, arrivals


def test_seeded_lazy_and_in_time_order():
    spec = TraceSpec(seconds=1e9, rate_per_s=50, seed=3)
    first = list(itertools.islice(arrivals(spec), 2000))  # an endless trace: only what is asked is made
    assert first == list(itertools.islice(arrivals(spec), 2000))
    assert [a.at for a in first] == sorted(a.at for a in first)
    assert [a.id for a in first] == list(range(2000))


def test_prefixes_repeat_within_a_tenant_and_a_conversation_only():
    xs = list(arrivals(TraceSpec(seconds=200, rate_per_s=50, tenants=20)))
    by_head = {}
    for a in xs:
        assert len(a.blocks) == a.prompt // 128
        if a.blocks:
            by_head.setdefault(a.blocks[0], set()).add(a.tenant)
    assert all(len(t) == 1 for t in by_head.values())  # a system prompt's head is its tenant's
    assert len(by_head) < len(xs) / 10  # and it repeats
    follow_ups = [a for a in xs if a.tier != Tier.BATCH and len(a.blocks) > 15]
    assert follow_ups


def test_token_counts_are_heavy_tailed_and_clipped():
    xs = list(arrivals(TraceSpec(seconds=200, rate_per_s=50)))
    outputs = [a.output for a in xs]
    assert max(outputs) <= 2048 and min(outputs) >= 1
    assert statistics.mean(outputs) > 1.3 * statistics.median(outputs)  # a long right tail


def test_bursts_and_the_diurnal_curve_move_the_rate():
    flat = TraceSpec(seconds=400, rate_per_s=20, diurnal=0, seed=5)
    day = dataclasses.replace(flat, diurnal=0.8, day_s=400)  # a day squeezed into the run
    n_flat = sum(1 for _ in arrivals(flat))
    assert abs(n_flat - 8000) < 400
    halves = [0, 0]
    for a in arrivals(day):
        halves[a.at >= 200] += 1
    assert halves[0] > 2 * halves[1]  # the sine's crest, then its trough
    bursty = dataclasses.replace(flat, burst_every_s=20, burst_s=10, burst_factor=3)
    assert sum(1 for _ in arrivals(bursty)) > 1.4 * n_flat
