"""ballast/affinity.py on the real kernel: a process that calls itself VLLM::Worker and is
bound to some cores keeps them; every other process under the root is moved off them."""

import os
import subprocess
import sys

import pytest

from ballast.affinity import descendants, keep_off_model_workers, model_worker_cpus

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(len(CPUS) < 2 or not os.path.isdir("/proc"), reason="needs Linux and two cores")

# A child that names itself as vLLM's model worker does (prctl PR_SET_NAME) and binds itself
# to the first core, and a sibling that is anything else.
WORKER = f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"VLLM::Worker_0", 0, 0, 0)
os.sched_setaffinity(0, {{{CPUS[0]}}})
print("ready", flush=True)
time.sleep(60)
"""
OTHER = "import time; print('ready', flush=True); time.sleep(60)"


def spawn(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_the_control_plane_keeps_off_the_model_workers_cores():
    everywhere = os.sched_getaffinity(0)
    worker, other = spawn(WORKER), spawn(OTHER)
    try:
        assert {worker.pid, other.pid} <= set(descendants(os.getpid()))
        assert model_worker_cpus(descendants(os.getpid())) == {CPUS[0]}
        held = keep_off_model_workers(os.getpid())
        assert held == {CPUS[0]}
        assert os.sched_getaffinity(worker.pid) == {CPUS[0]}  # vLLM's own binding stays
        assert os.sched_getaffinity(other.pid) == everywhere - {CPUS[0]}
        assert os.sched_getaffinity(0) == everywhere - {CPUS[0]}  # the root too, every thread
    finally:
        for tid in map(int, os.listdir(f"/proc/{os.getpid()}/task")):
            os.sched_setaffinity(tid, everywhere)
        for p in (worker, other):
            p.kill()
            p.wait()


def test_nothing_moves_where_no_model_worker_is_bound():
    other = spawn(OTHER)
    try:
        assert keep_off_model_workers(os.getpid()) == set()
        assert os.sched_getaffinity(other.pid) == os.sched_getaffinity(0)
    finally:
        other.kill()
        other.wait()
