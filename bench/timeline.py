"""Where a benchmark run's time goes: CPU per process, sampled from /proc, and the picture.

`CpuSampler` follows a process tree (the bench itself for the raw arm, `ballast up` for
the Ballast arm) and records each process's CPU seconds every `every_s`, named by role.
`draw` turns two arms' samples and engine timelines into one PNG: vLLM's running and
waiting sequences, when each item reached vLLM and left it (with activity starts and
checkpoint commits), and CPU per process, side by side on one time axis per arm.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ballast.cpus import descendants

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Roles, by what a process calls itself or how it was started; the first match wins.
ROLES = (
    ("vLLM engine core", lambda comm, cmd: comm.startswith("VLLM::EngineCor")),
    ("vLLM worker", lambda comm, cmd: comm.startswith("VLLM::") or "VllmWorker" in comm),
    ("engine worker", lambda comm, cmd: "worker engine" in cmd),
    ("control worker", lambda comm, cmd: "worker control" in cmd),
    ("API", lambda comm, cmd: "ballast.cli api" in cmd or cmd.endswith(" api")),
    ("Temporal", lambda comm, cmd: "temporal" in comm or "temporal" in cmd.split(" ")[0]),
    ("Postgres", lambda comm, cmd: "postgres" in comm),
)
VLLM_ROLES = ("vLLM engine core", "vLLM worker")


def _cpu(pid: int) -> tuple[str, str, float] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    comm = stat.split("(", 1)[1].rsplit(")", 1)[0]
    fields = stat.rsplit(")", 1)[1].split()
    return comm, cmd, (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def role(comm: str, cmd: str, default: str = "other") -> str:
    return next((name for name, match in ROLES if match(comm, cmd)), default)


@dataclass
class CpuSampler:
    """CPU seconds by role over time, for every process under `root`."""

    root: int
    root_role: str = "other"  # what the root itself is (the raw arm: vLLM's frontend)
    every_s: float = 0.25
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (role, cpu at start)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _read(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for pid in descendants(self.root):
            got = _cpu(pid)
            if got is None:
                continue
            comm, cmd, cpu = got
            name = self.root_role if pid == self.root else role(comm, cmd)
            start = self._seen.setdefault(pid, (name, cpu))[1]
            totals[name] = totals.get(name, 0.0) + cpu - start
        # Processes that exited keep what they used: their last reading stays in the total.
        return totals

    def __enter__(self) -> CpuSampler:
        self._read()  # the baseline: everything counts from here
        self.samples.append((time.time(), {}))

        def loop() -> None:
            while not self._stop.wait(self.every_s):
                totals = self._read()
                self.samples.append((time.time(), totals))  # as of the read's end: /proc is read in ms

        self._thread = threading.Thread(target=loop, daemon=True, name="cpu-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        totals = self._read()
        self.samples.append((time.time(), totals))

    def totals(self) -> dict[str, float]:
        last = self.samples[-1][1] if self.samples else {}
        return {k: round(v, 2) for k, v in sorted(last.items(), key=lambda kv: -kv[1])}


def draw(path: Path, arms: list[dict[str, Any]], title: str) -> None:
    """One column per arm: `name`, `t0` (wall), `load` [(t, running, waiting)], `items`
    [(submit, finish)], `activities` [t], `commits` [(t, ms)], `cpu` CpuSampler.samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(arms), figsize=(7 * len(arms), 9), sharex="col", squeeze=False,
                             gridspec_kw=dict(height_ratios=[1, 2, 1.2]))
    roles = sorted({r for arm in arms for _, c in arm["cpu"] for r in c}, key=lambda r: (r not in VLLM_ROLES, r))
    colors = {r: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(roles)}
    for col, arm in enumerate(arms):
        t0 = arm["t0"]
        top, mid, bottom = axes[0][col], axes[1][col], axes[2][col]
        top.set_title(arm["name"])
        if arm["load"]:
            ts = [t - t0 for t, _, _ in arm["load"]]
            top.step(ts, [r for _, r, _ in arm["load"]], where="post", label="running")
            top.step(ts, [w for _, _, w in arm["load"]], where="post", label="waiting")
        top.set_ylabel("vLLM sequences")
        top.legend(loc="upper right", fontsize=8)
        for i, (a, b) in enumerate(sorted(arm["items"])):
            mid.plot([a - t0, b - t0], [i, i], color="tab:blue", linewidth=0.6)
        for t in arm.get("activities", []):
            mid.axvline(t - t0, color="tab:green", linewidth=0.5, alpha=0.6)
        for t, _ in arm.get("commits", []):
            mid.plot([t - t0], [-3], marker="|", color="tab:red", markersize=6)
        mid.set_ylabel("items (in vLLM: line)\ngreen: activity starts, red: commits")
        _stack_cpu(bottom, arm["cpu"], t0, roles, colors)
        bottom.set_ylabel("CPU (cores)")
        bottom.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[r]) for r in roles]
    fig.legend(handles, roles, loc="lower center", ncol=min(len(roles), 8), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _stack_cpu(ax, samples: list[tuple[float, dict[str, float]]], t0: float, roles: list[str], colors) -> None:
    """Cores used per role between consecutive samples, stacked."""
    if len(samples) < 2:
        return
    ts: list[float] = []
    rates: dict[str, list[float]] = {r: [] for r in roles}
    for (ta, a), (tb, b) in zip(samples, samples[1:], strict=False):
        ts.append(ta - t0)
        for r in roles:
            rates[r].append(max(0.0, (b.get(r, 0.0) - a.get(r, 0.0)) / max(tb - ta, 1e-6)))
    ax.stackplot(ts, [rates[r] for r in roles], colors=[colors[r] for r in roles], step="post")
