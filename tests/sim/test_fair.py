"""Hand-worked: two tenants, one slot. The model's numbers as in test_engine.py (a step
takes step_s + seq_s × running; a prefill stalls prefill_s_per_token × its tokens)."""

import pytest

from policy import fairness as vtc
from protocol.tiers import Tier
from sim.engine import EngineSpec
from sim.loop import FleetSpec, RunSpec, run
from sim.trace import Arrival, TraceSpec, arrivals


def spec(mode):
    return EngineSpec(step_s=0.01, seq_s=0.005, prefill_s_per_token=1e-4, max_seqs=1, fair_share=mode)


def play(trace, mode):
    out = run(FleetSpec(engines_per_pool=1, engine=spec(mode)), trace, RunSpec("round_robin", keep_jobs=True))
    return {j.arrival.id: j for j in out.jobs}


TRACE = [Arrival(0, 0.0, 0, Tier.DEFAULT, 0, 0, 100, 3, ()),  # A1 takes the slot
         Arrival(1, 0.001, 0, Tier.DEFAULT, 0, 0, 100, 1, ()),  # A2 waits
         Arrival(2, 0.02, 1, Tier.DEFAULT, 0, 0, 100, 1, ())]  # B1 waits, behind A2 by arrival


def test_the_least_served_tenant_goes_first():
    # A1: prefill to 0.01, 3 steps of 0.015: ends at 0.055. A's counter: 100 at dispatch.
    # B arrives at 0.02, before A1's first token: lifted to the least active counter, 100.
    # At 0.055 A has 100 + 2 × 3 = 106, B 100: B1 goes before A2, though A2 came first.
    v = vtc.activate(vtc.Vtc(), "0")
    v = vtc.charge(v, "0", input_tokens=100)
    v = vtc.activate(v, "1")
    v = vtc.charge(v, "0", output_tokens=3)
    heads = [vtc.Head("0", Tier.DEFAULT, 1), vtc.Head("1", Tier.DEFAULT, 2)]
    assert v.counter("1") == 100 and vtc.pick(v, heads) == heads[1]
    jobs = play(TRACE, "vtc")
    assert jobs[0].finished == pytest.approx(0.055)
    assert jobs[2].first == pytest.approx(0.08) and jobs[2].finished == pytest.approx(0.08)
    assert jobs[1].first == pytest.approx(0.105)


def test_fcfs_serves_by_arrival():
    jobs = play(TRACE, "fcfs")
    assert jobs[1].first == pytest.approx(0.08) and jobs[2].first == pytest.approx(0.105)


def test_vtc_keeps_every_request_and_is_deterministic():
    trace = list(arrivals(TraceSpec(seconds=10, rate_per_s=80, seed=3, tenants=20)))
    fleet = FleetSpec(engines_per_pool=2, engine=EngineSpec(max_seqs=8, cache_blocks=64))

    def key():
        out = run(fleet, trace, RunSpec(keep_jobs=True))
        return sorted((j.arrival.id, j.engine, j.first, j.finished) for j in out.jobs)

    first = key()
    assert [k[0] for k in first] == [a.id for a in trace] and first == key()
