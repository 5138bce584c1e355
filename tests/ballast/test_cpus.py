"""ballast/cpus.py on the real kernel: a process that calls itself VLLM::Worker and is
bound to some cores keeps them; every other process under the root is moved off them.
Each test builds its own process tree (a root and its children), so nothing else that
runs under pytest (e2e stacks' real vLLM workers) is looked at or moved."""

import os
import signal
import subprocess
import sys

import pytest

from ballast.cpus import descendants, keep_off_model_workers, model_worker_cpus

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
ROOT = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for code in sys.argv[1:]]
for k in kids:
    k.stdout.readline()
print(*[k.pid for k in kids], flush=True)
time.sleep(60)
"""


def tree(*codes: str) -> tuple[subprocess.Popen, list[int]]:
    root = subprocess.Popen([sys.executable, "-c", ROOT, *codes], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert root.stdout is not None
    return root, [int(p) for p in root.stdout.readline().split()]


def stop(root: subprocess.Popen) -> None:
    os.killpg(root.pid, signal.SIGKILL)
    root.wait()


def test_the_control_plane_keeps_off_the_model_workers_cores():
    everywhere = os.sched_getaffinity(0)
    root, (worker, other) = tree(WORKER, OTHER)
    try:
        assert set(descendants(root.pid)) == {root.pid, worker, other}
        assert model_worker_cpus(descendants(root.pid)) == {CPUS[0]}
        assert keep_off_model_workers(root.pid) == {CPUS[0]}
        assert os.sched_getaffinity(worker) == {CPUS[0]}  # vLLM's own binding stays
        assert os.sched_getaffinity(other) == everywhere - {CPUS[0]}
        assert os.sched_getaffinity(root.pid) == everywhere - {CPUS[0]}  # the root too
        assert os.sched_getaffinity(0) == everywhere  # outside the tree: untouched
    finally:
        stop(root)


def test_nothing_moves_where_no_model_worker_is_bound():
    root, (other,) = tree(OTHER)
    try:
        before = os.sched_getaffinity(other)
        assert keep_off_model_workers(root.pid) == set()
        assert os.sched_getaffinity(other) == before
    finally:
        stop(root)


def test_engines_on_one_machine_get_their_own_cores():
    from ballast.cpus import split_cores

    assert split_cores([0, 1, 2, 3], 2) == ["0,1", "2,3"]
    assert split_cores([0, 1, 2, 3, 4], 2) == ["0,1", "2,3"]  # the odd core is left to the rest
    assert split_cores([0, 1], 3) == [None, None, None]  # fewer cores than engines: vLLM binds as alone
    assert split_cores([0, 1, 2, 3], 1) == [None]
