"""The simulator's figures as markdown tables."""

from __future__ import annotations

from sim.loop import Outcome
from sim.placement import HIT_RATIO, MAX_IMBALANCE, PlacementResult
from sim.quota import QuotaResult


def _ms(s: float) -> str:
    return f"{1000 * s:,.0f}"


def classes(o: Outcome) -> str:
    rows = ["| class | requests | TTFT p50 / p99 (ms) | end to end p50 / p99 (s) | prefix hit rate | preemptions |",
            "|---|---:|---:|---:|---:|---:|"]
    for c in o.classes:
        rows.append(f"| {c.tier} | {c.requests:,} | {_ms(c.ttft[0])} / {_ms(c.ttft[1])} | "
                    f"{c.e2e[0]:.2f} / {c.e2e[1]:.2f} | {c.hit_rate:.3f} | {c.preempted:,} |")
    return "\n".join(rows)


def fleet(o: Outcome) -> str:
    rate = o.requests / max(1e-9, o.cpu_s)
    return "\n".join([
        classes(o), "",
        "| engines | utilization (slots) | busy | prefix hit rate | load imbalance | pool surges "
        "| re-placed on region loss |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {o.engines:,} | {o.utilization:.3f} | {o.busy:.3f} | {o.hit_rate:.3f} | {o.imbalance:.3f} | "
        f"{o.surges:,} | {o.replaced:,} |", "",
        f"Simulated {o.requests:,} requests over {o.simulated_s:,.1f} virtual s in {o.wall_s:,.1f} wall s, "
        f"{o.cpu_s:,.1f} CPU s: {rate:,.0f} requests per CPU second ({o.arm} placement)."])


def placement(r: PlacementResult) -> str:
    s = r.setup
    rows = [f"{s.engines} engines, {s.seconds:g} s of prefix-heavy chat at {s.rate_per_engine * s.engines:g}/s "
            f"(seed {s.seed}): {r.distinct_blocks:,} distinct prefix blocks, {s.cache_blocks:,} per engine's cache.",
            "",
            "| arm | requests | prefix hit rate | load imbalance | TTFT p50 / p99 (ms) | end to end p50 / p99 (s) "
            "| utilization | CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for o in r.outcomes:
        c = o.classes[0]
        rows.append(f"| {o.arm} | {o.requests:,} | {o.hit_rate:.3f} | {o.imbalance:.3f} | {_ms(c.ttft[0])} / "
                    f"{_ms(c.ttft[1])} | {c.e2e[0]:.2f} / {c.e2e[1]:.2f} | {o.utilization:.3f} | {o.cpu_s:.1f} |")
    aff = r.arm("affinity")
    rows += ["", f"Affinity's hit rate {r.hit_ratio:.2f} × round-robin's (target ≥ {HIT_RATIO:g}), its imbalance "
                 f"{aff.imbalance:.3f} (target ≤ {MAX_IMBALANCE:g}): {'met' if r.met else 'missed'}."]
    return "\n".join(rows)


def quota(r: QuotaResult) -> str:
    s = r.setup
    rows = [f"One tenant over {s.regions} regions, {s.minutes} min at {s.demand:g} × its limit of "
            f"{s.limit_per_min:,} input tokens a minute ({s.tier} tier); reconciled every {s.reconcile_s:g} s.", "",
            "| admission | admitted / limit | worst overshoot | added latency p50 / p99 (ms) | messages / s |",
            "|---|---:|---:|---:|---:|"]
    for m in r.modes:
        rows.append(f"| {m.name} | {m.admitted_share:.3f} | {m.overshoot:.3%} | {_ms(m.added_p50_s)} / "
                    f"{_ms(m.added_p99_s)} | {m.messages_per_s:,.1f} |")
    return "\n".join(rows)
