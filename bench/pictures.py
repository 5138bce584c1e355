"""The benchmarks' pictures, drawn from what each run measured (the batch run's timeline is
bench/timeline.py): the surge run, fairness between tenants, and a fine-tune under chats.
Each takes plain data (the surge run also keeps its picture's in its JSON line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHADE = dict(color="tab:orange", alpha=0.18, linewidth=0)
FLEET = dict(facecolor="none", edgecolor="tab:red", hatch="//", alpha=0.5, linewidth=0)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shade(ax: Any, spans: list[tuple[float, float]], style: dict[str, Any] = SHADE) -> None:
    for a, b in spans:
        ax.axvspan(a, b, **style)


def draw_surge(path: Path, arms: dict[str, dict[str, Any]], title: str) -> None:
    """One column per arm, over one round of its interactive load: each chat's TTFT at the
    moment it arrived, above the batch's tokens/s as the journal committed them (1 s bins),
    with the surge shaded in both: the load's own (`load_surge`, when chats arrive five
    times as often) and, hatched, any the fleet controller declared on the pool (`surges`).
    `arms[name]`: `chats` [(t, ttft_s)], `tokens` [(t, n)], `surges` [(t0, t1)], every t in
    seconds from the round's start, and `seconds` (the round's length)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(arms), figsize=(5 * len(arms), 6.5), sharex="col", sharey="row", squeeze=False,
                             gridspec_kw=dict(height_ratios=[1.3, 1]))
    for col, (name, arm) in enumerate(arms.items()):
        top, bottom = axes[0][col], axes[1][col]
        top.set_title(name)
        for ax in (top, bottom):
            if arm.get("load_surge"):
                _shade(ax, [tuple(arm["load_surge"])])
            _shade(ax, arm["surges"], FLEET)
            ax.set_xlim(0, arm["seconds"])
        if arm["chats"]:
            top.scatter([t for t, _ in arm["chats"]], [1000 * s for _, s in arm["chats"]], s=9, color="tab:blue")
        top.set_yscale("log")
        if arm["tokens"]:
            bottom.bar([t for t, _ in arm["tokens"]], [n for _, n in arm["tokens"]], width=1.0, align="edge",
                       color="tab:green")
        bottom.set_xlabel("seconds into the round")
    axes[0][0].set_ylabel("chat TTFT (ms, log)")
    axes[1][0].set_ylabel("batch tokens/s (journaled)")
    fig.suptitle(f"{title}\nshaded: the surge (chats arriving 5x as often); hatched: the fleet controller's surges "
                 "on the pool, if any", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_fairness(path: Path, arms: dict[str, dict[str, Any]], title: str) -> None:
    """One panel per scheduler: each tenant's weighted service (input + 2 × output tokens)
    received at the client, cumulative over the backlog. `arms[name]`: `tenants`
    {tenant: [(t, cumulative)]}, t in seconds from the backlog's start."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(arms), figsize=(5.5 * len(arms), 4), sharey=True, squeeze=False)
    for col, (name, arm) in enumerate(arms.items()):
        ax = axes[0][col]
        ax.set_title(name)
        for tenant, points in arm["tenants"].items():
            ax.step([t for t, _ in points], [s / 1000 for _, s in points], where="post", label=tenant)
        ax.set_xlabel("seconds into the backlog")
        ax.legend(loc="upper left", fontsize=8)
    axes[0][0].set_ylabel("service received (thousand weighted tokens)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_training(path: Path, jobs: dict[str, list[dict[str, Any]]], title: str) -> None:
    """One panel per job: training loss at every step, each checkpoint a tick at its step,
    coloured by what ended its chunk (a chat preempting it, its steps, the job's end).
    `jobs[name]`: the job's checkpoint payloads in order (`step`, `losses` of the steps
    since the one before, `ended_by`)."""
    plt = _pyplot()
    colours = dict(preempted="tab:red", steps="tab:gray", done="tab:green", cancelled="black")
    cols = min(2, len(jobs))
    rows = -(-len(jobs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.6 * rows), squeeze=False)
    for k, (name, ckpts) in enumerate(jobs.items()):
        ax = axes[k // cols][k % cols]
        steps: list[int] = []
        losses: list[float] = []
        before = 0
        for c in ckpts:
            steps += range(before + 1, before + 1 + len(c["losses"]))
            losses += c["losses"]
            before = c["step"]
        ax.plot(steps, losses, linewidth=0.8, color="tab:blue", label="training loss")
        seen = set()
        for c in ckpts:
            why = c.get("ended_by") or "steps"
            ax.axvline(c["step"], color=colours.get(why, "tab:purple"), linewidth=0.7, alpha=0.8,
                       label=None if why in seen else f"checkpoint ({why})")
            seen.add(why)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(loc="upper right", fontsize=8)
    for k in range(len(jobs), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
