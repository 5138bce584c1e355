"""`ballast up`'s supervisor over real processes: a crashed child is restarted after its
backoff and says so with its exit code and log; a crash loop gives up with the reason;
a healthy child is left alone; a child killed soon after it said it serves is restarted
however often it happens."""

import os
import sys
import time

import pytest

from ballast.supervise import Supervisor
from policy.restarts import RestartPolicy


def run_until(sup: Supervisor, done, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (msg := sup.tick()) is not None:
            return msg
        if done():
            return None
        time.sleep(0.05)
    raise AssertionError("supervision did not get there in time")


def test_a_crashing_child_is_restarted_with_its_exit_code_said_then_a_loop_gives_up(tmp_path):
    said: list[str] = []
    sup = Supervisor(RestartPolicy(initial_backoff_s=0.1, max_backoff_s=0.2, healthy_after_s=30, max_quick_crashes=3),
                     say=said.append)
    crash = sup.start("flaky", [sys.executable, "-c", "print('boom, bad setting'); raise SystemExit(3)"], {},
                      tmp_path / "flaky.log")
    calm = sup.start("calm", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "calm.log")
    try:
        gave_up = run_until(sup, lambda: False)
        assert gave_up is not None and gave_up.startswith("flaky keeps crashing (code 3; 3 times in a row")
        assert "boom, bad setting" in gave_up and str(tmp_path / "flaky.log") in gave_up
        assert [m.split(";")[0] for m in said if m.startswith("flaky exited")] == ["flaky exited (code 3)"] * 2
        assert "restarting in 0.1 s" in said[0] and "restarting in 0.2 s" in said[2]  # doubling
        assert crash.restarts == 2 and calm.restarts == 0 and calm.child.alive
        # In our session (its nice values rank it against the others'), in a group of its own.
        assert os.getsid(calm.child.pid) == os.getsid(0) and os.getpgid(calm.child.pid) == calm.child.pid
    finally:
        sup.stop_all(5)
    assert not calm.child.alive


def test_a_child_that_dies_after_saying_it_serves_is_restarted_every_time(tmp_path):
    said: list[str] = []
    sup = Supervisor(RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, healthy_after_s=30, max_quick_crashes=2),
                     say=said.append)
    script = "from ballast import procs; procs.notify_ready(); raise SystemExit(9)"
    dies = sup.start("served", [sys.executable, "-c", script], {}, tmp_path / "served.log")
    try:
        assert run_until(sup, lambda: dies.restarts >= 5) is None  # never a crash loop
        assert any(m == "served is serving again (restart 1)" for m in said)
        assert len([m for m in said if m.startswith("served exited (code 9); restarting in 0.05 s")]) >= 5
    finally:
        sup.stop_all(5)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to narrow one's set")
def test_a_restarted_child_gets_every_core_back_and_the_serving_hook_runs(tmp_path):
    """`ballast up` narrows its own cores (and its children's) off vLLM's; a process it starts
    again must not inherit that, or a restarted engine binds vLLM inside the narrow set."""
    everything = os.sched_getaffinity(0)
    served: list[str] = []
    sup = Supervisor(RestartPolicy(initial_backoff_s=0.05), say=lambda _: None,
                     on_serving=lambda s: served.append(s.name))
    script = ("import os, time; from ballast import procs; print(sorted(os.sched_getaffinity(0)), flush=True); "
              "procs.notify_ready(); time.sleep(0.3)")
    log = tmp_path / "cores.log"
    child = sup.start("cores", [sys.executable, "-c", script], {}, log)
    try:
        os.sched_setaffinity(0, {min(everything)})  # as keep_off_model_workers does to `ballast up`
        assert run_until(sup, lambda: child.restarts >= 1 and "cores" in served) is None
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("[")]
        assert len(lines) >= 2 and all(ln == str(sorted(everything)) for ln in lines), lines
    finally:
        os.sched_setaffinity(0, everything)
        sup.stop_all(5)
