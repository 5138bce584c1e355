"""On a CPU engine, Ballast's own processes keep off the cores vLLM's model worker holds.

vLLM's CPU backend binds its model worker's threads to every core but those it reserves
(`VLLM_CPU_OMP_THREADS_BIND=auto` reserves one) for the serving processes around it: its
engine core and frontend. On one machine (`ballast up`) the control plane is such a
process too: the engine worker (vLLM's frontend), Postgres, Temporal, the API and the
control worker. Left free, the kernel also wakes them on the model worker's cores, where
each wake-up preempts a forward pass (vLLM runs niced below them) and every sequence's
step waits for it. Kept on the reserved cores they only take what vLLM leaves there.
`ballast bench batch` measures it (bench/RESULTS.md). On a GPU node vLLM binds nothing
and nothing changes here.
"""

from __future__ import annotations

import logging
import os

from ballast import procs

log = logging.getLogger(__name__)


def descendants(root: int) -> list[int]:
    """`root` and every live process under it (Linux), from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in procs.live_processes():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def model_worker_cpus(pids: list[int]) -> set[int]:
    """The cores vLLM binds its model workers (VLLM::Worker…) to, when they do not hold
    them all (empty otherwise: nothing to keep off)."""
    everything = os.sched_getaffinity(0)
    held: set[int] = set()
    for pid in pids:
        if _comm(pid).startswith("VLLM::Worker"):
            try:
                held |= os.sched_getaffinity(pid)
            except OSError:
                continue
    return held if held and held < everything else set()


def keep_off_model_workers(root: int) -> set[int]:
    """Move every process under `root` but vLLM's model workers (every thread: threads
    started later inherit) off the model workers' cores. Returns those cores."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc"):
        return set()
    pids = descendants(root)
    held = model_worker_cpus(pids)
    if not held:
        return set()
    for pid in pids:
        if _comm(pid).startswith("VLLM::Worker"):
            continue
        try:
            allowed = os.sched_getaffinity(pid) - held
            for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                os.sched_setaffinity(tid, allowed or os.sched_getaffinity(pid))
        except OSError:
            continue  # gone, or not ours to move
    return held


def split_cores(cores: list[int], n: int) -> list[str | None]:
    """`n` engines on one machine: each vLLM model worker bound to its own share of the
    cores (VLLM_CPU_OMP_THREADS_BIND), so they do not fight over the same ones; None each
    where there are fewer cores than engines (vLLM binds as it would alone)."""
    if n <= 1 or len(cores) < n:
        return [None] * n
    share = len(cores) // n
    return [",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(n)]
