"""The pool-level half of preemption: when is a pool surging, and what does batch keep."""

from __future__ import annotations

from policy.preemption import pool_step, pressure
from protocol.fleet import EngineReport, Surge, SurgePolicy

POLICY = SurgePolicy(high=0.8, low=0.5, cool_down_s=10.0, batch_share=0.25)


def report(id: str, interactive: int = 0, waiting: int = 0, kv: float = 0.0, pool: str = "m", max_seqs: int = 8,
           batch: int = 0, cap: int | None = None) -> EngineReport:
    return EngineReport(id, pool, max_seqs, interactive, batch, interactive + batch, waiting, kv, cap)


def test_pressure_is_chat_and_queue_against_slots_or_kv_under_chat():
    assert pressure(report("a")) == 0.0
    assert pressure(report("a", interactive=2, waiting=2)) == 0.5
    assert pressure(report("a", interactive=1, kv=0.9)) == 0.9
    assert pressure(report("a", batch=8, kv=0.95)) == 0.0  # a KV cache full of batch is batch doing its job
    assert pressure(report("a", interactive=8, waiting=30)) == 1.0
    # A batch's items queued inside vLLM, with no chat anywhere: batch doing its job too.
    assert pressure(report("a", batch=8, waiting=200, max_seqs=256)) == 0.0


def test_a_batch_filling_vllms_queue_alone_starts_no_surge():
    """bench batch found it: 256 items submitted at once sat in vLLM's queue for the first
    second; the controller called that a surge and preempted the batch for its cool-down."""
    start = [report("a", batch=256, waiting=230, max_seqs=256)]
    d = pool_step("m", start, Surge(), 0.0, POLICY)
    assert not d.started and not d.state.surging and d.caps == (("a", None),)
    # With chat in flight the same queue is chat's wait too: it counts.
    d = pool_step("m", [report("a", interactive=4, batch=252, waiting=230, max_seqs=256)], Surge(), 1.0, POLICY)
    assert d.started


def test_a_pool_surges_at_high_and_calms_only_after_staying_under_low_for_the_cool_down():
    quiet, busy, middling = [report("a")], [report("a", interactive=7)], [report("a", interactive=5)]
    d = pool_step("m", middling, Surge(), 0.0, POLICY)
    assert not d.state.surging and not d.started  # 0.625 < high
    d = pool_step("m", busy, d.state, 1.0, POLICY)
    assert d.started and d.state == Surge(True, 1.0, None) and d.pressure == 0.875
    d = pool_step("m", middling, d.state, 2.0, POLICY)
    assert d.state == Surge(True, 1.0, None)  # between low and high: still surging, calm not begun
    d = pool_step("m", quiet, d.state, 3.0, POLICY)
    assert d.state == Surge(True, 1.0, 3.0) and not d.ended
    d = pool_step("m", middling, d.state, 8.0, POLICY)
    assert d.state == Surge(True, 1.0, None)  # pressure back above low: the calm starts over
    d = pool_step("m", quiet, d.state, 9.0, POLICY)
    d = pool_step("m", quiet, d.state, 18.9, POLICY)
    assert d.state.surging and not d.ended
    d = pool_step("m", quiet, d.state, 19.0, POLICY)
    assert d.ended and d.state == Surge()


def test_during_a_surge_every_engine_of_the_pool_keeps_batch_to_its_share():
    reports = [report("b", max_seqs=16), report("a", interactive=8), report("c", interactive=8, pool="other")]
    d = pool_step("m", reports, Surge(), 0.0, POLICY)
    # The pressed engine is a; b (no chat yet) is capped too; the other pool is not ours.
    assert d.started and d.caps == (("a", 2), ("b", 4))
    calm = pool_step("m", [report("a"), report("b")], Surge(), 5.0, POLICY)
    assert calm.caps == (("a", None), ("b", None)) and not calm.started


def test_an_empty_pool_calms_down():
    d = pool_step("m", [], Surge(True, 0.0, None), 1.0, POLICY)
    assert d.pressure == 0.0 and d.state == Surge(True, 0.0, 1.0)
    assert pool_step("m", [], d.state, 11.0, POLICY).ended
