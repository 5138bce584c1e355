"""`ballast bench fairness`: two tenants of one tier on one saturated engine, by token.

Two arms, the same load, each on a fresh `ballast up` (API → engine worker → vLLM, its
own embedded Postgres) with few sequence slots (BALLAST_MAX_NUM_SEQS, 8) so that the
engine queues: `fcfs` (BALLAST_FAIR_SHARE=fcfs: served by arrival within a tier, as
before) and `vtc` (the default: the Virtual Token Counter, engine/fairness.py). Two
tenants of equal weight (1), made in the stack's database, each with its own key; every
request is a streaming chat completion of the `default` tier with `ignore_eos`, so its
length is what it asks for.

1. backlog: each tenant runs a closed loop of `concurrency` requests (16: twice the slots,
   so that each tenant has requests waiting at the engine despite the client and API
   turnaround between a request and its successor: both backlogged); tenant `short`
   asks for P prompt and M output tokens, tenant `long` for 10 P and 10 M. Service is
   weighted as VTC counts it, input + 2 × output tokens (the paper's default), and
   attributed client-side: the prompt when the first token arrives, the output across
   the stream's chunks. Per window (`--window`, 5 s) each tenant's weighted tokens/s and
   Jain's index (Σx)² / (n Σx²) (1: equal; 0.5: one tenant gets everything); and the
   largest difference in service the two got over any interval of the run, against VTC's
   bound, 2 × the largest request's cost (Sheng et al., OSDI'24): as the client saw it
   (prompt at the first token, output as it streamed) and as the engine's own counters
   (its /stats, sampled every 50 ms; kept in both arms) counted it.
2. giant prompts: tenant `short` sends short requests open-loop (Poisson, `--rate`/s) and
   its TTFT p50/p99 is taken alone, then while tenant `long` keeps the engine backlogged
   with prompts near the context limit (2 × the slots in streams: some always wait).

Prints a table per arm, then one JSON line with the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import string
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import select

from ballast.settings import Settings
from bench.stack import ballast_up
from journal import schema, tenants
from journal.db import connect

SEED = 7
W_IN, W_OUT = 1, 2  # VTC's weights: input + 2 × output tokens


@dataclass
class Tenant:
    name: str
    key: str
    prompt: int  # tokens
    max_tokens: int
    events: list[tuple[float, float]] = field(default_factory=list)  # (time, weighted tokens)
    ttft: list[float] = field(default_factory=list)
    requests: int = 0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def jain(xs: list[float]) -> float:
    s2 = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * s2) if s2 else 1.0


async def make_tenants(db_url: str, names: list[str]) -> tuple[dict[str, str], str]:
    """A key per tenant (weight 1), and the stack's engine worker's URL."""
    db = connect(db_url, pool_size=1)
    try:
        async with db.begin() as conn:
            keys = {}
            for n in names:
                await tenants.ensure_tenant(conn, n, 1)
                keys[n] = (await tenants.create_key(conn, n, "bench"))[1]
            url = (await conn.execute(select(schema.engines.c.url).limit(1))).scalar_one()
            return keys, url
    finally:
        await db.dispose()


async def sample_counters(http: httpx.AsyncClient, engine_url: str, stop: asyncio.Event,
                          out: list[tuple[float, dict[str, float]]],
                          queued: list[tuple[float, dict[str, int]]]) -> None:
    """The engine's own VTC counters and who has requests waiting there (its /stats), every 50 ms."""
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            fair = (await http.get(engine_url + "/stats")).json()["fairness"]
            out.append((time.monotonic(), fair["counters"]))
            queued.append((time.monotonic(), fair["waiting"]))
        await asyncio.sleep(0.05)


def counter_difference(samples: list[tuple[float, dict[str, float]]], start: float, end: float) -> float:
    """The largest difference in service as the engine counted it, over any interval."""
    d = [c.get("short", 0.0) - c.get("long", 0.0) for at, c in samples if start <= at <= end]
    return max(d) - min(d) if d else float("nan")


class Load:
    def __init__(self, http: httpx.AsyncClient, model: str, template_tokens: int, seed: int = SEED):
        self.http, self.model, self.template = http, model, template_tokens
        self.rng = random.Random(seed)

    def content(self, prompt_tokens: int) -> str:
        # The tiny model's tokenizer is byte-level: one letter, one token. Random letters:
        # no two prompts share a prefix the engine could cache.
        n = max(1, prompt_tokens - self.template)
        return "".join(self.rng.choices(string.ascii_lowercase, k=n))

    async def one(self, t: Tenant, prompt_tokens: int | None = None, max_tokens: int | None = None) -> None:
        body = dict(model=self.model, stream=True, stream_options=dict(include_usage=True), ignore_eos=True,
                    max_tokens=max_tokens or t.max_tokens, temperature=0,
                    messages=[dict(role="user", content=self.content(prompt_tokens or t.prompt))])
        t0 = time.monotonic()
        chunks: list[float] = []
        usage = None
        async with self.http.stream("POST", "/v1/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {t.key}"}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{t.name}: {r.status_code} {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    chunks.append(time.monotonic())
        if not chunks or usage is None:
            return
        t.requests += 1
        t.ttft.append(1000 * (chunks[0] - t0))
        t.events.append((chunks[0], W_IN * usage["prompt_tokens"]))
        per = W_OUT * usage["completion_tokens"] / len(chunks)
        t.events.extend((c, per) for c in chunks)

    async def closed_loop(self, t: Tenant, concurrency: int, stop: asyncio.Event) -> None:
        async def loop() -> None:
            while not stop.is_set():
                await self.one(t)

        await asyncio.gather(*(loop() for _ in range(concurrency)))

    async def open_loop(self, t: Tenant, rate: float, seconds: float) -> None:
        tasks, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(self.one(t)))
            await asyncio.sleep(self.rng.expovariate(rate))
        await asyncio.gather(*tasks)


def windows(ts: list[Tenant], start: float, end: float, width: float) -> list[list[float]]:
    """Weighted tokens/s per tenant, per whole window in [start, end)."""
    n = int((end - start) // width)
    out = [[0.0] * len(ts) for _ in range(n)]
    for i, t in enumerate(ts):
        for at, w in t.events:
            k = int((at - start) // width)
            if 0 <= k < n:
                out[k][i] += w / width
    return out


def max_service_difference(a: Tenant, b: Tenant, start: float, end: float) -> float:
    """The largest |service(a) − service(b)| over any interval inside [start, end]."""
    merged = sorted([(at, w) for at, w in a.events if start <= at <= end]
                    + [(at, -w) for at, w in b.events if start <= at <= end])
    d, lo, hi = 0.0, 0.0, 0.0
    for _, w in merged:
        d += w
        lo, hi = min(lo, d), max(hi, d)
    return hi - lo


async def scenarios(base_url: str, keys: dict[str, str], engine_url: str, model: str, seconds: float, window: float,
                    concurrency: int, rate: float, prompt: int, out_tokens: int, giant: int, giant_streams: int,
                    log) -> dict:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        probe = Tenant("short", keys["short"], 1, 1)
        calib = Load(http, model, 0)
        await calib.one(probe, 1, 4)  # also the engine's first (slow) request
        template = int(probe.events[0][1] / W_IN) - 1 if probe.events else 0
        load = Load(http, model, template)

        # 1. both backlogged, one tenant's requests 10× the other's
        short = Tenant("short", keys["short"], prompt, out_tokens)
        long_ = Tenant("long", keys["long"], 10 * prompt, 10 * out_tokens)
        stop = asyncio.Event()
        warm = min(5.0, seconds / 4)
        t0 = time.monotonic()
        samples: list[tuple[float, dict[str, float]]] = []
        queued: list[tuple[float, dict[str, int]]] = []
        running = asyncio.gather(load.closed_loop(short, concurrency, stop), load.closed_loop(long_, concurrency, stop),
                                 sample_counters(http, engine_url, stop, samples, queued))
        await asyncio.sleep(warm + seconds)
        stop.set()
        start, end = t0 + warm, t0 + warm + seconds
        await running  # the last requests finish; only [start, end) is counted
        ws = windows([short, long_], start, end, window)
        jains = [jain(w) for w in ws]
        largest = max(W_IN * long_.prompt + W_OUT * long_.max_tokens, W_IN * short.prompt + W_OUT * short.max_tokens)
        backlog = dict(
            windows=[[round(x) for x in w] for w in ws], jain=[round(j, 3) for j in jains],
            jain_min=round(min(jains), 3) if jains else None,
            jain_median=round(statistics.median(jains), 3) if jains else None,
            tokens_per_s=dict(short=round(sum(w[0] for w in ws) / max(1, len(ws))),
                              long=round(sum(w[1] for w in ws) / max(1, len(ws)))),
            requests=dict(short=short.requests, long=long_.requests),
            max_service_diff=round(max_service_difference(short, long_, start, end)),
            engine_counter_diff=round(counter_difference(samples, start, end)),
            bound=2 * largest,
            # VTC's bound holds for tenants with requests waiting: how often each had (vtc arm only)
            waiting_share={n: round(sum(1 for at, w in queued if start <= at <= end and w.get(n))
                                    / max(1, sum(1 for at, _ in queued if start <= at <= end)), 2)
                           for n in ("short", "long")},
        )
        log(f"  backlog: Jain per window {backlog['jain']}, weighted tok/s {backlog['tokens_per_s']}, "
            f"max service difference {backlog['max_service_diff']} as the client saw it, "
            f"{backlog['engine_counter_diff']} as the engine counted it (bound {backlog['bound']}); "
            f"share of samples with requests waiting at the engine {backlog['waiting_share']}")

        # 2. interactive TTFT, alone and beside giant prompts
        half = seconds / 2
        alone = Tenant("short", keys["short"], prompt, 8)
        await load.open_loop(alone, rate, half)
        beside = Tenant("short", keys["short"], prompt, 8)
        giants = Tenant("long", keys["long"], giant, 16)
        stop = asyncio.Event()
        background = asyncio.create_task(load.closed_loop(giants, giant_streams, stop))
        await asyncio.sleep(min(3.0, half / 2))  # the backlog builds
        await load.open_loop(beside, rate, half)
        stop.set()
        await background
        p99_alone, p99_beside = pct(alone.ttft, 99), pct(beside.ttft, 99)
        ttft = dict(alone_p50=round(pct(alone.ttft, 50), 1), alone_p99=round(p99_alone, 1),
                    giant_p50=round(pct(beside.ttft, 50), 1), giant_p99=round(p99_beside, 1),
                    p99_ratio=round(p99_beside / p99_alone, 2) if p99_alone else None,
                    requests=dict(alone=alone.requests, beside=beside.requests, giants=giants.requests))
        log(f"  giant prompts: short TTFT p50/p99 alone {ttft['alone_p50']}/{ttft['alone_p99']} ms, "
            f"beside {giant}-token prompts {ttft['giant_p50']}/{ttft['giant_p99']} ms (p99 ×{ttft['p99_ratio']})")
        return dict(backlog=backlog, ttft=ttft, template_tokens=template)


def main(settings: Settings, seconds: float = 20.0, window: float = 5.0, concurrency: int = 16, max_num_seqs: int = 8,
         rate: float = 4.0, prompt: int = 64, out_tokens: int = 32, log=print) -> int:
    giant = settings.max_model_len - 64
    log(f"bench fairness: {max_num_seqs} sequence slots, 2 tenants of weight 1 × {concurrency} streams, "
        f"{seconds:.0f} s backlog ({window:.0f} s windows), requests {prompt}+{out_tokens} vs "
        f"{10 * prompt}+{10 * out_tokens} tokens; then TTFT at {rate}/s beside {giant}-token prompts")
    figures: dict[str, dict] = {}
    for arm in ("fcfs", "vtc"):
        log(f"arm {arm}:")
        with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, \
                ballast_up(settings, Path(d), BALLAST_MAX_NUM_SEQS=str(max_num_seqs), BALLAST_FAIR_SHARE=arm) as st:
            keys, engine_url = asyncio.run(make_tenants(st.db_url, ["short", "long"]))
            figures[arm] = asyncio.run(scenarios(str(st.api.base_url), keys, engine_url, settings.model_name, seconds,
                                                 window, concurrency, rate, prompt, out_tokens, giant,
                                                 2 * max_num_seqs, log))
    log(f"\n{'arm':5} {'Jain min':>8} {'median':>7} {'short tok/s':>11} {'long tok/s':>10} {'max diff':>9} "
        f"{'engine':>7} {'bound':>6} {'TTFT p99 alone':>14} {'beside giants':>13} {'ratio':>6}")
    for arm, f in figures.items():
        b, t = f["backlog"], f["ttft"]
        log(f"{arm:5} {b['jain_min']:>8} {b['jain_median']:>7} {b['tokens_per_s']['short']:>11} "
            f"{b['tokens_per_s']['long']:>10} {b['max_service_diff']:>9} {b['engine_counter_diff']:>7} {b['bound']:>6} "
            f"{t['alone_p99']:>12}ms {t['giant_p99']:>11}ms {t['p99_ratio']:>6}")
    out = dict(bench="fairness", weights="input + 2 x output tokens", max_num_seqs=max_num_seqs,
               concurrency=concurrency, seconds=seconds, window_s=window,
               requests=dict(short=[prompt, out_tokens], long=[10 * prompt, 10 * out_tokens], giant=[giant, 16]),
               **{arm: dict(jain_min=f["backlog"]["jain_min"], jain_median=f["backlog"]["jain_median"],
                            max_service_diff=f["backlog"]["max_service_diff"],
                            engine_counter_diff=f["backlog"]["engine_counter_diff"], bound=f["backlog"]["bound"],
                            waiting_share=f["backlog"]["waiting_share"],
                            tokens_per_s=f["backlog"]["tokens_per_s"], ttft_p99_alone_ms=f["ttft"]["alone_p99"],
                            ttft_p99_giants_ms=f["ttft"]["giant_p99"], ttft_p99_ratio=f["ttft"]["p99_ratio"])
                  for arm, f in figures.items()})
    print(json.dumps(out))
    return 0
