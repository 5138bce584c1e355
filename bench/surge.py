"""`ballast bench surge`: interactive traffic on an engine that batch work backfills.

Three arms, one engine, one run, the same seeded interactive arrivals:
  alone    interactive requests only;
  ballast  plus batch backfill under Ballast's slots: batch runs at low priority, yields
           (abort + resume from its tokens) when interactive work arrives, returns after
           the cool-down;
  fifo     plus the same backfill with no preemption and no priorities.
An extra short arm runs the backfill alone, to know the engine's batch capacity. The
backfill has as many streams as the engine has sequence slots (vLLM max_num_seqs). Prints
TTFT p50/p99 and TPOT per arm (and as ratios to `alone`), batch tokens/s harvested and
the share of idle capacity that is, preemption latency (decision → engine slot free) and
tokens re-prefilled per preemption; then one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ballast.settings import Settings
from engine.slots import EngineSlots
from policy.preemption import TIERS

SEED = 11


@dataclass
class Arm:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # time with at least one interactive request in flight
    batch_tokens: int = 0
    reprefill: int = 0
    seconds: float = 0.0
    slots: EngineSlots | None = None


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def run_arm(engine, mode: str, duration_s: float, rate: float, backfill: int, seed: int = SEED) -> Arm:
    rng = random.Random(seed)
    arm = Arm()
    slots = EngineSlots(max(backfill, 1), busy_cap=0, cool_down_s=0.5, preemption=(mode == "ballast"))
    arm.slots = slots
    inflight = [0]
    busy_since = [0.0]
    stop = asyncio.Event()

    async def interactive(i: int) -> None:
        prompt = engine.render_chat([dict(role="user", content=f"question {i}: {'x' * rng.randint(20, 120)}")])
        t0 = time.perf_counter()
        inflight[0] += 1
        if inflight[0] == 1:
            busy_since[0] = t0
        first: float | None = None
        last: float | None = None
        n = 0
        async with slots.interactive_request():
            async for step in engine.generate(f"i-{mode}-{i}", prompt, max_tokens=32, temperature=0.0, ignore_eos=True,
                                              priority=0):
                if step.token_ids:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += len(step.token_ids)
        inflight[0] -= 1
        if inflight[0] == 0:
            arm.busy_s += time.perf_counter() - busy_since[0]
        assert first is not None and last is not None, "an interactive request produced no tokens"
        arm.ttft.append(first - t0)
        if n > 1:
            arm.tpot.append((last - first) / (n - 1))

    async def batch_worker(w: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = engine.render_text(f"batch {w}-{k} " + "y" * 200)
            tokens: list[int] = []
            while len(tokens) < 256 and not stop.is_set():
                rid = f"b-{mode}-{w}-{k}-{len(tokens)}"
                if tokens:
                    arm.reprefill += len(prompt) + len(tokens)
                prio = TIERS["batch"] if mode == "ballast" else 0
                async with slots.batch(rid, prio, partial(engine.abort, rid)):
                    async for step in engine.generate(rid, prompt + tokens, max_tokens=256 - len(tokens),
                                                      temperature=0.0, ignore_eos=True, priority=prio):
                        tokens += step.token_ids
                        arm.batch_tokens += len(step.token_ids)
            k += 1

    workers = [asyncio.create_task(batch_worker(w)) for w in range(backfill)]
    t0 = time.perf_counter()
    tasks, i = [], 0
    while time.perf_counter() - t0 < duration_s:
        # Bursty arrivals: quiet gaps, then a few requests close together.
        await asyncio.sleep(rng.expovariate(rate))
        for _ in range(rng.choice((1, 1, 2, 4))):
            tasks.append(asyncio.create_task(interactive(i)))
            i += 1
    await asyncio.gather(*tasks)
    arm.seconds = time.perf_counter() - t0
    stop.set()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return arm


async def batch_alone(engine, backfill: int, seconds: float) -> float:
    arm = Arm()
    stop = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        k = 0
        while time.perf_counter() < stop:
            prompt = engine.render_text(f"alone {w}-{k} " + "y" * 200)
            async for step in engine.generate(f"a-{w}-{k}", prompt, max_tokens=256, temperature=0.0, ignore_eos=True):
                arm.batch_tokens += len(step.token_ids)
            k += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(backfill)))
    return arm.batch_tokens / (time.perf_counter() - t0)


async def bench(settings: Settings, duration_s: float, rate: float, backfill: int) -> dict:
    from engine.models import resolve_model
    from engine.vllm_engine import Engine

    # Batch backfill fills every sequence slot, as it would on a busy fleet: without
    # preemption an interactive request waits for a batch sequence to finish.
    engine = await Engine.start(resolve_model(settings), kv_cache_gib=settings.kv_cache_gib, max_num_seqs=backfill,
                                nice=settings.engine_nice)
    try:
        await run_arm(engine, "alone", 2, rate, 0, seed=1)  # warm-up
        capacity = await batch_alone(engine, backfill, 5)
        arms = {m: await run_arm(engine, m, duration_s, rate, 0 if m == "alone" else backfill)
                for m in ("alone", "ballast", "fifo")}
    finally:
        engine.shutdown()
    alone = arms["alone"]
    out: dict[str, Any] = dict(bench="surge", duration_s=duration_s, arrival_rate=rate, backfill=backfill,
                               batch_alone_tokens_per_s=round(capacity, 1))
    for name, a in arms.items():
        idle = max(0.0, 1 - a.busy_s / a.seconds)
        harvest = a.batch_tokens / a.seconds
        out[name] = dict(
            requests=len(a.ttft), ttft_p50_ms=round(1000 * pct(a.ttft, 50), 1),
            ttft_p99_ms=round(1000 * pct(a.ttft, 99), 1),
            tpot_ms=round(1000 * statistics.mean(a.tpot), 2),
            ttft_p50_ratio=round(pct(a.ttft, 50) / pct(alone.ttft, 50), 3),
            ttft_p99_ratio=round(pct(a.ttft, 99) / pct(alone.ttft, 99), 3),
            tpot_ratio=round(statistics.mean(a.tpot) / statistics.mean(alone.tpot), 3),
            batch_tokens_per_s=round(harvest, 1),
            idle_share=round(idle, 3),
            harvest_of_idle=round(harvest / (capacity * idle), 3) if idle and name != "alone" else None,
        )
    ballast_slots = arms["ballast"].slots
    assert ballast_slots is not None  # run_arm sets it
    s = ballast_slots.stats
    out["ballast"].update(
        preemptions=s.preemptions,
        preemption_ms_p50=round(1000 * pct(s.latencies_s, 50), 2),
        preemption_ms_p99=round(1000 * pct(s.latencies_s, 99), 2),
        reprefill_tokens_per_preemption=round(arms["ballast"].reprefill / max(1, s.preemptions), 1),
    )
    return out


def main(settings: Settings, duration_s: float = 30.0, rate: float = 1.0, backfill: int = 32) -> int:
    print(f"bench surge: {duration_s:.0f} s per arm, bursts at {rate}/s, {backfill} batch streams backfilling",
          flush=True)
    out = asyncio.run(bench(settings, duration_s, rate, backfill))
    print(f"\nbatch alone: {out['batch_alone_tokens_per_s']} tokens/s")
    print(f"{'arm':8} {'n':>4} {'TTFT p50':>9} {'p99':>8} {'TPOT':>7} {'p50×':>6} {'p99×':>6} {'TPOT×':>6} "
          f"{'batch tok/s':>11} {'of idle':>8}")
    for name in ("alone", "ballast", "fifo"):
        a = out[name]
        print(f"{name:8} {a['requests']:4d} {a['ttft_p50_ms']:7.1f}ms {a['ttft_p99_ms']:6.1f}ms {a['tpot_ms']:5.2f}ms "
              f"{a['ttft_p50_ratio']:6.2f} {a['ttft_p99_ratio']:6.2f} {a['tpot_ratio']:6.2f} "
              f"{a['batch_tokens_per_s']:11.1f} "
              f"{a['harvest_of_idle'] if a['harvest_of_idle'] is not None else '-':>8}")
    b = out["ballast"]
    print(f"preemptions {b['preemptions']}, latency p50 {b['preemption_ms_p50']} ms p99 {b['preemption_ms_p99']} ms, "
          f"re-prefilled {b['reprefill_tokens_per_preemption']} tokens per preemption")
    print(json.dumps(out))
    return 0
