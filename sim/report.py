"""The simulator's figures as markdown tables."""

from __future__ import annotations

from sim.fairness import FairnessResult
from sim.grouping import GroupingResult
from sim.loop import Outcome
from sim.placement import HIT_RATIO, MAX_IMBALANCE, PlacementResult
from sim.quota import QuotaResult
from sim.replay import Replay, verdict


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


def replay(r: Replay) -> str:
    f = r.fit
    rows = [f"Costs fitted to the recording ({f.samples} requests): decode {1000 * f.step_s:.2f} ms a step + "
            f"{1000 * f.seq_s:.2f} ms a sequence in flight; prefill {1e6 * f.prefill_s_per_token:.1f} µs a token; "
            f"{1000 * f.delay_s:.0f} ms from placement to the engine's queue (TTFT's intercept, "
            f"{1000 * f.ttft_intercept_s:.0f} ms, less a step: the API's and the worker's handling, in flight).", "",
            "| arm | trace | n | same engine | hit rate real / sim | imbalance real / sim | TTFT p50 real / sim (ms) |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for a in r.arms:
        for t in a.traces:
            rows.append(f"| {a.arm} | {t.trace} | {t.real.requests} | {t.same_engine:.1%} | "
                        f"{t.real.hit_rate:.3f} / {t.sim.hit_rate:.3f} | "
                        f"{t.real.imbalance:.3f} / {t.sim.imbalance:.3f} | "
                        f"{t.real.ttft_p50_ms:.0f} / {t.sim.ttft_p50_ms:.0f} |")
    rows.append("")
    for a in r.arms:
        how = ("relabelled " + ", ".join(f"sim {s} = real {e}" for s, e in a.labels) if a.relabelled
               else "engines matched by their real ids, no relabelling needed")
        rows.append(f"- {a.arm}: {a.same_engine:.1%} of {len(a.placed)} requests on the same engine ({how}); "
                    f"{a.stepwise:.1%} step by step, each decision from the real history.")
    if {"affinity", "round_robin"} <= {a.arm for a in r.arms}:
        rows.append(f"- Affinity's hit rate over round-robin's (prefix-heavy): real {r.ratio('real'):.2f}×, "
                    f"sim {r.ratio('sim'):.2f}×.")
    rows += ["", "| tolerance | met | figures |", "|---|---|---|"]
    rows += [f"| {c.what} | {'met' if c.met else '**not met**'} | {c.detail} |" for c in verdict(r)]
    return "\n".join(rows)


def fairness(r: FairnessResult) -> str:
    s = r.setup
    rows = [f"{s.engines} engines (affinity placement), {s.seconds:g} s, default tier (seed {s.seed}): tenant 0 sends "
            f"{s.heavy_rate:g}/s ({s.overload:g} × the pool's ~{s.capacity_per_engine * s.engines:g}/s), "
            f"tenants 1–{s.light_tenants} {s.light_rate:g}/s each. Served: input + 2 × output tokens by the last "
            f"arrival ({r.until:.1f} s).", "",
            "| queue | tenant | requests | TTFT p50 / p99 (ms) | served (k) | served / demand | share of served |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for a in r.arms:
        for t in a.tenants:
            who = f"{t.tenant} (heavy)" if t.tenant == 0 else f"{t.tenant}"
            rows.append(f"| {a.arm} | {who} | {t.requests:,} | {_ms(t.ttft[0])} / {_ms(t.ttft[1])} | "
                        f"{t.served / 1000:,.0f} | {t.served / max(1e-9, t.demand):.2f} | {t.share:.3f} |")
    return "\n".join(rows)


def grouping(r: GroupingResult) -> str:
    s, b = r.setup, r.setup.batch
    rows = [f"One batch of {b.items:,} items on {s.engines} idle engines ({s.engine.cache_blocks:,} cache blocks "
            f"each), {b.prefixes} shared prefixes (median {b.prefix_median:,} tokens) + a question (median "
            f"{b.user_median}), concurrency {s.concurrency}, groups of ≤ {s.group_size} (seed {b.seed}).", "",
            "| arm | items | groups | prefix hit rate | prefill tokens (M) | completion (s) | items on busiest engine "
            "/ mean | CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a in r.arms:
        rows.append(f"| {a.arm} | {a.items:,} | {a.groups:,} | {a.hit_rate:.3f} | {a.prefilled / 1e6:.2f} | "
                    f"{a.completion_s:.1f} | {a.spread:.3f} | {a.cpu_s:.1f} |")
    return "\n".join(rows)
