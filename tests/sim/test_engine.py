"""Hand-worked cases: the numbers below are computed on paper from the model in
sim/engine.py's docstring (a step takes step_s + seq_s × running; a prefill stalls the
engine prefill_s_per_token × its uncached tokens; every output token is one step)."""

import pytest

from protocol.fleet import SurgePolicy
from protocol.tiers import Tier
from sim.engine import EngineSpec
from sim.loop import FleetSpec, RunSpec, run
from sim.trace import Arrival

SPEC = EngineSpec(step_s=0.01, seq_s=0.005, prefill_s_per_token=1e-4, max_seqs=2, block_size=128, cache_blocks=4)


def arrival(i, at, prompt, output, blocks=(), tier=Tier.DEFAULT):
    return Arrival(i, at, 0, tier, 0, 0, prompt, output, tuple(blocks))


def play(arrivals, engines=1, spec=SPEC, arm="round_robin"):
    out = run(FleetSpec(engines_per_pool=engines, engine=spec), arrivals, RunSpec(arm, keep_jobs=True))
    return {j.arrival.id: j for j in out.jobs}, out


def test_two_engines_five_requests_round_robin():
    a, d = (11, 12), (41, 42)
    jobs, out = play([arrival(0, 0.0, 256, 3, a), arrival(1, 0.1, 256, 2, a), arrival(2, 0.2, 256, 2, a),
                      arrival(3, 0.2, 300, 1, d), arrival(4, 0.25, 128, 1, a[:1])], engines=2)
    # Round robin turns first: e001, e000, e001, e000, e001.
    assert [jobs[i].engine[-4:] for i in range(5)] == ["e001", "e000", "e001", "e000", "e001"]
    # A: 256 uncached tokens stall 0.0256 s, then steps of 0.015 s.
    assert jobs[0].first == pytest.approx(0.0406) and jobs[0].finished == pytest.approx(0.0706)
    # B: alone on e000, a miss there.
    assert jobs[1].first == pytest.approx(0.1406) and jobs[1].finished == pytest.approx(0.1556)
    # C: A's blocks are on e001: all but the last token cached, 1 token prefilled.
    assert jobs[2].first == pytest.approx(0.2151) and jobs[2].finished == pytest.approx(0.2301)
    # D: 300 tokens (2 full blocks) missed on e000.
    assert jobs[3].finished == pytest.approx(0.245)
    # E: its one block is cached on e001.
    assert jobs[4].finished == pytest.approx(0.2651)
    assert [(jobs[i].cached, jobs[i].queried) for i in range(5)] == [(0, 256), (0, 256), (255, 256), (0, 300),
                                                                   (127, 128)]
    assert out.hit_rate == pytest.approx(382 / 1196)


def test_a_prefill_stalls_the_running_sequence_and_steps_slow_with_company():
    jobs, _ = play([arrival(0, 0.0, 100, 2), arrival(1, 0.01, 100, 2)])
    # X's prefill ends at 0.01, Y's then stalls both to 0.02; two running: 0.02 s a step.
    for j in (0, 1):
        assert jobs[j].first == pytest.approx(0.04) and jobs[j].finished == pytest.approx(0.06)


def test_a_full_engine_queues():
    one = EngineSpec(step_s=0.01, seq_s=0.005, prefill_s_per_token=1e-4, max_seqs=1)
    jobs, _ = play([arrival(0, 0.0, 100, 2), arrival(1, 0.01, 100, 1)], spec=one)
    assert jobs[0].finished == pytest.approx(0.04)
    assert jobs[1].first == pytest.approx(0.065) and jobs[1].finished == pytest.approx(0.065)


def test_batch_yields_to_chat_and_resumes_after_the_cool_down():
    jobs, _ = play([arrival(0, 0.0, 100, 100, tier=Tier.BATCH), arrival(1, 0.05, 100, 2)])
    b, chat = jobs[0], jobs[1]
    # The chat preempts the batch item (busy_cap 0) after its 2 whole tokens, runs alone...
    assert chat.first == pytest.approx(0.075) and chat.finished == pytest.approx(0.09)
    assert b.preempted == 1 and b.first == pytest.approx(0.025)
    # ...and batch resumes 2 s of calm later, re-prefilling 100 + 2 tokens, with 98 to go.
    assert b.finished == pytest.approx(0.09 + 2.0 + 0.0102 + 98 * 0.015)
    assert b.queried == 100 + 102 and b.done == 100


def test_a_surging_pool_takes_batch_s_slots_where_no_chat_has_come_yet():
    trace = [arrival(0, 0.0, 100, 100, tier=Tier.BATCH), arrival(1, 0.1, 100, 200),
             arrival(2, 0.2, 100, 100, tier=Tier.BATCH), arrival(3, 0.3, 100, 200)]
    jobs, out = play(trace, engines=2)
    # Round robin: batch on e001, both chats on e000, whose slots they fill: pressure 1.0.
    assert {jobs[i].engine[-4:] for i in (0, 2)} == {"e001"} and {jobs[i].engine[-4:] for i in (1, 3)} == {"e000"}
    # The tick at 1 s starts a surge; e001's batch yields (batch_share 0) though it has no chat...
    assert out.surges == 1 and jobs[0].preempted == jobs[2].preempted == 1
    # ...until the chats are done (~4.3 s) and pressure has stayed low for the 10 s cool-down.
    assert jobs[1].finished < 5 and jobs[0].finished > 14
    calm = run(FleetSpec(engines_per_pool=2, engine=SPEC), trace,
               RunSpec("round_robin", surge=SurgePolicy(high=2.0), keep_jobs=True))
    assert calm.surges == 0 and all(j.preempted == 0 for j in calm.jobs)


def test_a_delay_before_the_queue_counts_in_flight_but_holds_no_slot():
    # delay_s 0.05: X reaches the engine at 0.05, prefills 100 tokens (0.01 s), then 2 steps of 0.015 s.
    slow = EngineSpec(step_s=0.01, seq_s=0.005, prefill_s_per_token=1e-4, max_seqs=2, delay_s=0.05)
    jobs, _ = play([arrival(0, 0.0, 100, 2), arrival(1, 0.01, 100, 1)], engines=2, spec=slow, arm="least_loaded")
    assert jobs[0].first == pytest.approx(0.075) and jobs[0].finished == pytest.approx(0.09)
    # Y, placed while X was still on its way, sees it in flight there and goes to the other engine.
    assert jobs[0].engine != jobs[1].engine
    assert jobs[1].first == pytest.approx(0.085) and jobs[1].finished == pytest.approx(0.085)
