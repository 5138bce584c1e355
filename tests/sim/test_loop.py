import dataclasses

import pytest

from sim.engine import EngineSpec
from sim.loop import ARMS, FleetSpec, RunSpec, run
from sim.trace import TraceSpec, arrivals

TRACE = TraceSpec(seconds=20, rate_per_s=60, seed=7, regions=2, models=2, tenants=50, burst_every_s=5, burst_s=2,
                  diurnal=0.3, day_s=40)
FLEET = FleetSpec(regions=2, models=2, engines_per_pool=3, engine=EngineSpec(max_seqs=8, cache_blocks=64))


@pytest.mark.parametrize("arm", ARMS)
def test_every_request_finishes_once_with_its_tokens(arm):
    trace = list(arrivals(TRACE))
    out = run(FLEET, trace, RunSpec(arm, keep_jobs=True))
    ids = [j.arrival.id for j in out.jobs]
    assert sorted(ids) == [a.id for a in trace]  # each once (the engine asserts its slots)
    for j in out.jobs:
        a = j.arrival
        assert a.at <= j.placed <= j.first <= j.finished
        assert j.done == a.output and 0 <= j.cached <= j.queried
        assert j.queried >= a.prompt  # re-prefills after preemption count again
        assert j.engine.startswith(f"r{a.region:02d}-m{a.model}-")  # placed in its home pool
    assert out.requests == len(trace) and 0 < out.utilization <= out.busy <= 1


def test_the_same_seed_gives_the_same_run():
    def key(out):
        return ([dataclasses.astuple(c) for c in out.classes],
                [(j.arrival.id, j.engine, j.first, j.finished, j.cached) for j in out.jobs], out.imbalance)

    first = run(FLEET, arrivals(TRACE), RunSpec(keep_jobs=True))
    assert key(first) == key(run(FLEET, arrivals(TRACE), RunSpec(keep_jobs=True)))
    other = run(FLEET, arrivals(dataclasses.replace(TRACE, seed=8)), RunSpec(keep_jobs=True))
    assert key(first) != key(other)


def test_a_lost_region_s_work_moves_up_and_still_finishes():
    trace = list(arrivals(TRACE))
    out = run(FLEET, trace, RunSpec(lose_region=0, lose_at=10.0, keep_jobs=True))
    assert sorted(j.arrival.id for j in out.jobs) == [a.id for a in trace]
    assert out.replaced > 0
    late = [j for j in out.jobs if j.arrival.at > 10.0]
    assert late and all(j.engine.startswith("r01-") for j in late)
