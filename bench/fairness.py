"""`ballast bench fairness`: two tenants of one tier on one saturated engine, by token.

Two arms side by side in one run, the same load, each on a fresh `ballast up` (API →
engine worker → vLLM, its own embedded Postgres) with few sequence slots
(BALLAST_MAX_NUM_SEQS, 8) so that the engine queues: `fcfs` (BALLAST_FAIR_SHARE=fcfs:
served by arrival within a tier, as before) and `vtc` (the default: the Virtual Token
Counter, engine/fair_share.py). Two tenants of equal weight (1), made in the stack's
database, each with its own key; every request is a streaming chat completion of the
`default` tier with `ignore_eos`, so its length is what it asks for.

Service is measured at the client, never with the scheduler's counters: each streamed
token's arrival time, per tenant, weighted as VTC counts it (input + 2 × output tokens):
a request's prompt (its usage's `prompt_tokens`) at its first token, each output token
at the SSE event that carried it. Where the stream carried more than one token in an
event (the usage's `completion_tokens` exceed the events), that request's tokens are
spread evenly over its events, and the share of such requests is reported.

1. backlog: each tenant runs a closed loop of streams (`streams`: enough that each has
   requests waiting at the engine despite the client and API turnaround between a request
   and its successor; the short tenant needs more, finishing ten requests to the long
   one's one); tenant `short` asks for P prompt and M output tokens, tenant `long` for
   10 P and 10 M. Per window (`window`, 5 s) Jain's index (Σx)² / (n Σx²) of the service
   the client received (1: equal; 0.5: one tenant gets everything). VTC's bound (Sheng et
   al., OSDI'24) is stated for two tenants that are both backlogged: over any interval in
   which both have requests waiting, their service differs by at most 2 × the largest
   request's cost (2 × (10 P + 2 × 10 M)). The engine worker's /stats, sampled every
   50 ms, says only *when* both had requests waiting there (its `waiting`); the service
   difference over any interval inside such a stretch is computed from the client's token
   timestamps alone (`backlogged_diff`), and over any interval of the run
   (`max_service_diff`, no backlog condition). In `fcfs` nothing waits at the engine
   worker (vLLM holds the queue, per tenant unseen), so there is no such stretch; the
   client's record says instead how many requests each tenant had outstanding at least
   (more than the slots: some were not running). Diagnostics, not figures: the same
   stretches as the scheduler's own `served` counters saw them, the slots it gave out of
   turn (to a tenant while one served less had nothing waiting: work-conserving, outside
   the bound), and each request's TTFT as the client, the API and the engine worker saw it.
2. giant prompts: tenant `short` sends short requests open-loop (Poisson, `rate`/s); its
   TTFT p50/p99 alone, then while tenant `long` keeps the engine backlogged with prompts
   near the context limit; the journal splits each TTFT into the API's and the engine's.

Prints a table per arm, then one JSON line with the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import string
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import select
from sqlalchemy.engine import make_url

from ballast import pg
from bench.pictures import draw_fairness
from bench.stack import ballast_up
from bench.stats import p50, pct
from config import Settings
from journal import schema, tenant_store
from journal.db import connect

SEED = 7
PICTURE = Path(__file__).with_name("fairness.png")
W_IN, W_OUT = 1, 2  # VTC's weights: input + 2 × output tokens


@dataclass
class Tenant:
    name: str
    key: str
    prompt: int  # tokens
    max_tokens: int
    events: list[tuple[float, float]] = field(default_factory=list)  # (arrival at the client, weighted tokens)
    ttft: list[float] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    requests: int = 0
    dropped: int = 0  # connections closed before a response (counted, not retried)
    sse_events: int = 0  # token events received (each a chunk with a delta)
    tokens: int = 0  # completion tokens, as each response's usage counts them
    merged: int = 0  # responses with fewer token events than tokens (some event carried several)
    in_flight: int = 0
    outstanding: list[tuple[float, int]] = field(default_factory=list)  # (time, requests sent, not ended)

    def sent(self, delta: int) -> None:
        self.in_flight += delta
        self.outstanding.append((time.monotonic(), self.in_flight))


def owner_url(stack_db_url: str, data_dir: Path) -> str:
    """The stack's Postgres as its owner: the embedded server asks every role for its
    password (the superuser's is kept in the data dir, ballast/pg.py)."""
    url = make_url(stack_db_url)
    kept = data_dir / pg.PASSWORD_FILE
    if url.password is None and kept.exists():
        url = url.set(password=kept.read_text().strip())
    return url.render_as_string(hide_password=False)


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
                await tenant_store.ensure_tenant(conn, n, 1)
                keys[n] = (await tenant_store.create_key(conn, n, "bench"))[1]
            url = (await conn.execute(select(schema.engines.c.url).limit(1))).scalar_one()
            return keys, url
    finally:
        await db.dispose()


async def sample_engine(http: httpx.AsyncClient, engine_url: str, engine_headers: dict[str, str],
                          stop: asyncio.Event,
                          out: list[tuple[float, dict[str, float]]],
                          queued: list[tuple[float, dict[str, int]]],
                          turns: list[tuple[float, dict[str, int]]] | None = None) -> None:
    """What the engine served each tenant (weighted as VTC counts, without its lifts) and who
    has requests waiting there (its /stats), every 50 ms."""
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            fair = (await http.get(engine_url + "/stats", headers=engine_headers)).json()["fairness"]
            out.append((time.monotonic(), fair["served"]))
            queued.append((time.monotonic(), fair["waiting"]))
            if turns is not None:
                turns.append((time.monotonic(), fair.get("out_of_turn", {})))
        await asyncio.sleep(0.05)


def both_waiting(w: dict[str, int]) -> bool:
    return bool(w.get("short")) and bool(w.get("long"))


def backlogged_stretches(queued: list[tuple[float, dict[str, int]]], start: float,
                         end: float) -> list[tuple[float, float]]:
    """Where VTC's bound is stated: the stretches of consecutive samples of the engine
    worker's /stats inside [start, end] in which both tenants had requests waiting there,
    each as (its first sample's time, its last's). A gap between two samples where one
    tenant's queue emptied and filled again is not seen (samples every 50 ms)."""
    out: list[tuple[float, float]] = []
    first: float | None = None
    last = 0.0
    for at, w in queued:
        if not start <= at <= end:
            continue
        if both_waiting(w):
            first, last = (at if first is None else first), at
        elif first is not None:
            out.append((first, last))
            first = None
    if first is not None:
        out.append((first, last))
    return out


def both_share(queued: list[tuple[float, dict[str, int]]], start: float, end: float) -> float:
    """The share of samples inside [start, end] in which both tenants had requests waiting."""
    inside = [w for at, w in queued if start <= at <= end]
    return sum(map(both_waiting, inside)) / len(inside) if inside else float("nan")


def counter_difference(samples: list[tuple[float, dict[str, float]]], start: float, end: float) -> float:
    """The largest difference in service over any interval inside [start, end], as the
    scheduler's own counters saw it (a diagnostic beside the client's figure)."""
    d = [c.get("short", 0.0) - c.get("long", 0.0) for at, c in samples if start <= at <= end]
    return max(d) - min(d) if d else 0.0


def outstanding_min(t: Tenant, start: float, end: float) -> int:
    """The fewest requests `t` had sent and not seen end at any moment in [start, end]."""
    before = [n for at, n in t.outstanding if at <= start]
    inside = [n for at, n in t.outstanding if start < at <= end]
    return min(before[-1:] + inside, default=0)


def token_event(chunk: dict) -> bool:
    """An SSE chunk that carries generated tokens: a delta that is not the opening role
    chunk, before the finish. Its text may be empty (a byte-level token that is part of a
    character): it still carries a token."""
    choices = chunk.get("choices") or [{}]
    return "delta" in choices[0] and "role" not in choices[0]["delta"] and choices[0].get("finish_reason") is None


def service_events(arrivals: list[float], prompt_tokens: int, completion_tokens: int) -> list[tuple[float, float]]:
    """One response's service as VTC weighs it, at the times the client received it: the
    prompt at the first token, each output token at the event that carried it (spread
    evenly over the events where some event carried more than one)."""
    per = W_OUT * completion_tokens / len(arrivals)
    return [(arrivals[0], W_IN * prompt_tokens)] + [(at, per) for at in arrivals]


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
        t.sent(1)
        try:
            await self._one(t, prompt_tokens, max_tokens)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # A pooled keep-alive connection the server closed as the request went out (the
            # client's race with uvicorn's keep-alive timeout, more likely with many streams).
            t.dropped += 1
        finally:
            t.sent(-1)

    async def _one(self, t: Tenant, prompt_tokens: int | None, max_tokens: int | None) -> None:
        body = dict(model=self.model, stream=True, stream_options=dict(include_usage=True), ignore_eos=True,
                    max_tokens=max_tokens or t.max_tokens, temperature=0,
                    messages=[dict(role="user", content=self.content(prompt_tokens or t.prompt))])
        t0 = time.monotonic()
        chunks: list[float] = []
        usage, rid = None, None
        async with self.http.stream("POST", "/v1/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {t.key}"}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{t.name}: {r.status_code} {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rid = rid or chunk.get("id")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if token_event(chunk):
                    chunks.append(time.monotonic())
        if not chunks or usage is None:
            return
        t.requests += 1
        t.ttft.append(1000 * (chunks[0] - t0))
        t.ids.append(rid or "")
        t.events.extend(service_events(chunks, usage["prompt_tokens"], usage["completion_tokens"]))
        t.sse_events += len(chunks)
        t.tokens += usage["completion_tokens"]
        t.merged += len(chunks) < usage["completion_tokens"]

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


@dataclass
class Scene:
    """One arm's stack and what the scenarios share."""

    http: httpx.AsyncClient
    keys: dict[str, str]
    engine_url: str
    engine_headers: dict[str, str]
    db_url: str
    load: Load
    log: Callable[[str], None]


async def backlog(sc: Scene, seconds: float, window: float, streams: dict[str, int], prompt: int,
                  out_tokens: int) -> dict:
    """1. Both tenants backlogged, one's requests 10× the other's. Each keeps a closed loop
    of streams: enough that it has requests waiting at the engine despite the client and
    API turnaround between a request and its successor (the short tenant needs more: it
    finishes ten requests for the long one's one). Service per window and the service
    difference from the client's token timestamps: over any interval, and over any interval
    inside a stretch where both had requests waiting at the engine worker (where VTC's
    bound is stated; the engine's /stats, sampled every 50 ms, marks the stretches)."""
    short = Tenant("short", sc.keys["short"], prompt, out_tokens)
    long_ = Tenant("long", sc.keys["long"], 10 * prompt, 10 * out_tokens)
    stop = asyncio.Event()
    warm = min(5.0, seconds / 4)
    t0 = time.monotonic()
    served: list[tuple[float, dict[str, float]]] = []
    queued: list[tuple[float, dict[str, int]]] = []
    turns: list[tuple[float, dict[str, int]]] = []
    running = asyncio.gather(sc.load.closed_loop(short, streams["short"], stop),
                             sc.load.closed_loop(long_, streams["long"], stop),
                             sample_engine(sc.http, sc.engine_url, sc.engine_headers, stop, served, queued, turns))
    await asyncio.sleep(warm + seconds)
    stop.set()
    start, end = t0 + warm, t0 + warm + seconds
    await running  # the last requests finish; only [start, end) is counted
    ws = windows([short, long_], start, end, window)
    jains = [jain(w) for w in ws]
    both_per_window = [both_share(queued, start + k * window, start + (k + 1) * window) for k in range(len(ws))]
    # windows in which both tenants had requests waiting at the engine in ≥ 90 % of samples
    backlogged = [k for k, share in enumerate(both_per_window) if share >= 0.9]
    largest = max(W_IN * long_.prompt + W_OUT * long_.max_tokens, W_IN * short.prompt + W_OUT * short.max_tokens)
    bound = 2 * largest
    stretches = backlogged_stretches(queued, start, end)
    client_diffs = [max_service_difference(short, long_, a, b) for a, b in stretches]
    worst = max(range(len(stretches)), key=client_diffs.__getitem__, default=None)
    # Where a request's time goes before the engine: the client's TTFT, the API's (from its
    # receipt) and the engine worker's (from its receipt; its fair-share wait included).
    split = await asyncio.to_thread(journaled_ttfts, sc.db_url, short.ids + long_.ids)
    every = short.ttft + long_.ttft
    both = both_share(queued, start, end)
    b = dict(
        ttft_p50_p99=dict(client=[round(pct(every, 50)), round(pct(every, 99))],
                          api=[round(pct(split["api"], 50)), round(pct(split["api"], 99))],
                          engine=[round(pct(split["engine"], 50)), round(pct(split["engine"], 99))]),
        windows=[[round(x) for x in w] for w in ws], jain=[round(j, 3) for j in jains],
        jain_min=round(min(jains), 3) if jains else None,
        jain_median=round(p50(jains), 3) if jains else None,
        both_waiting_per_window=[round(x, 2) for x in both_per_window],
        jain_min_backlogged=round(min(jains[k] for k in backlogged), 3) if backlogged else None,
        backlogged_windows=len(backlogged),
        tokens_per_s=dict(short=round(sum(w[0] for w in ws) / max(1, len(ws))),
                          long=round(sum(w[1] for w in ws) / max(1, len(ws)))),
        requests=dict(short=short.requests, long=long_.requests),
        dropped=dict(short=short.dropped, long=long_.dropped),
        # the client's figures: any interval of the run, and any interval while both waited
        max_service_diff=round(max_service_difference(short, long_, start, end)),
        backlogged_diff=round(max(client_diffs)) if stretches else None,
        bound=bound,
        stretches=len(stretches), stretches_over_bound=sum(d > bound for d in client_diffs),
        stretch_s=dict(p50=round(pct([b - a for a, b in stretches], 50), 2),
                       max=round(max((b - a for a, b in stretches), default=0.0), 2)),
        worst_stretch=None if worst is None else dict(
            at_s=round(stretches[worst][0] - start, 2), length_s=round(stretches[worst][1] - stretches[worst][0], 2),
            client_diff=round(client_diffs[worst]),
            scheduler_diff=round(counter_difference(served, *stretches[worst]))),
        both_waiting=round(both, 3) if both == both else None,
        waiting_share={n: round(sum(1 for at, w in queued if start <= at <= end and w.get(n))
                                / max(1, sum(1 for at, _ in queued if start <= at <= end)), 2)
                       for n in ("short", "long")},
        outstanding_min=dict(short=outstanding_min(short, start, end), long=outstanding_min(long_, start, end)),
        # how the stream carried tokens: one per SSE event, or some merged
        tokens_per_event=round((short.tokens + long_.tokens) / max(1, short.sse_events + long_.sse_events), 3),
        merged_responses=dict(short=short.merged, long=long_.merged),
        # diagnostics from the scheduler's own counters, beside the client's figures
        scheduler=dict(
            backlogged_diff=round(max((counter_difference(served, a, b) for a, b in stretches), default=0.0)),
            max_diff=round(counter_difference(served, start, end)),
            # slots the engine gave a tenant while the other, served less, had nothing waiting
            out_of_turn={n: (lambda xs: xs[-1].get(n, 0) - xs[0].get(n, 0) if xs else 0)(
                [o for at, o in turns if start <= at <= end]) for n in ("short", "long")}),
        # for the picture (bench/pictures.py): each tenant's service received, cumulative
        series={t.name: cumulative(t.events, start, end) for t in (short, long_)},
    )
    sc.log(f"  backlog: Jain per window {b['jain']} (client); weighted tok/s {b['tokens_per_s']}; largest service "
           f"difference at the client {b['max_service_diff']} over any interval, {b['backlogged_diff']} over any "
           f"interval while both had requests waiting at the engine (bound {b['bound']}; {b['stretches']} stretches "
           f"of both waiting, {b['stretches_over_bound']} over the bound; the worst {b['worst_stretch']}); share of "
           f"samples with requests waiting: {b['waiting_share']}, both {b['both_waiting']} (per window "
           f"{b['both_waiting_per_window']}: Jain's least over the {b['backlogged_windows']} windows where both were "
           f"≥ 90 % of the time {b['jain_min_backlogged']}); requests outstanding at least {b['outstanding_min']}; "
           f"tokens per SSE event {b['tokens_per_event']} (responses with merged events {b['merged_responses']}); "
           f"the scheduler's counters: {b['scheduler']}; TTFT p50/p99 ms as the client, the API and the engine "
           f"worker saw it {b['ttft_p50_p99']}")
    return b


def cumulative(events: list[tuple[float, float]], start: float, end: float, step: float = 0.25
               ) -> list[tuple[float, float]]:
    """Service received in [start, end), summed every `step` seconds: (seconds from start, total so far)."""
    bins = [0.0] * (int((end - start) / step) + 1)
    for at, w in events:
        if start <= at < end:
            bins[int((at - start) / step)] += w
    out, total = [], 0.0
    for k, w in enumerate(bins):
        total += w
        out.append((round(k * step, 2), total))
    return out


def journaled(db_url: str, request_ids: list[str]) -> dict[str, tuple[float | None, float | None]]:
    """Each request's TTFT in ms as the API and as the engine worker measured it (journaled
    with its `request_finished` event), by id: where the time went, before or inside the engine."""
    import psycopg

    with psycopg.connect(db_url) as conn:
        for _ in range(100):  # journaled a moment after the response, in the background
            rows = conn.execute("SELECT request_id, (record->>'ttft_ms')::float, (record->>'engine_ttft_ms')::float"
                                " FROM finished_requests WHERE request_id = ANY(%s)", (request_ids,)).fetchall()
            if len(rows) >= len(request_ids):
                break
            time.sleep(0.1)
    return {r[0]: (r[1], r[2]) for r in rows}


def journaled_ttfts(db_url: str, request_ids: list[str]) -> dict[str, list[float]]:
    """The requests' TTFTs in ms as the API and as the engine worker measured them."""
    rows = journaled(db_url, request_ids).values()
    return dict(api=[a for a, _ in rows if a is not None], engine=[e for _, e in rows if e is not None])


async def giant_prompts(sc: Scene, seconds: float, rate: float, prompt: int, giant: int, giant_streams: int) -> dict:
    """2. The short tenant's interactive TTFT, open loop (Poisson, `rate`/s), alone, then
    while the long tenant keeps the engine backlogged with prompts near the context limit.
    The journal splits each TTFT: the engine worker's (from its receipt of the request:
    its fair-share queue, vLLM's queue and the prefill) and the API's (from its receipt)."""
    alone = Tenant("short", sc.keys["short"], prompt, 8)
    await sc.load.open_loop(alone, rate, seconds)
    beside = Tenant("short", sc.keys["short"], prompt, 8)
    giants = Tenant("long", sc.keys["long"], giant, 16)
    stop = asyncio.Event()
    background = asyncio.create_task(sc.load.closed_loop(giants, giant_streams, stop))
    await asyncio.sleep(min(3.0, seconds / 2))  # the backlog builds
    await sc.load.open_loop(beside, rate, seconds)
    stop.set()
    await background
    p99_alone, p99_beside = pct(alone.ttft, 99), pct(beside.ttft, 99)
    split = {n: await asyncio.to_thread(journaled_ttfts, sc.db_url, x.ids) for n, x in (("alone", alone),
                                                                                        ("beside", beside))}
    t = dict(alone_p50=round(pct(alone.ttft, 50), 1), alone_p99=round(p99_alone, 1),
             giant_p50=round(pct(beside.ttft, 50), 1), giant_p99=round(p99_beside, 1),
             p99_ratio=round(p99_beside / p99_alone, 2) if p99_alone else None,
             requests=dict(alone=alone.requests, beside=beside.requests, giants=giants.requests),
             giant_tokens_per_s=round(sum(w for _, w in giants.events) / seconds),
             **{f"{side}_{n}_p50_p99": [round(pct(split[n][side], 50), 1), round(pct(split[n][side], 99), 1)]
                for side in ("api", "engine") for n in ("alone", "beside")})
    sc.log(f"  giant prompts: short TTFT p50/p99 alone {t['alone_p50']}/{t['alone_p99']} ms, beside {giant}-token "
           f"prompts {t['giant_p50']}/{t['giant_p99']} ms (p99 ×{t['p99_ratio']}); giants served "
           f"{t['giant_tokens_per_s']} weighted tok/s; TTFT p50/p99 as the API measured it "
           f"{t['api_alone_p50_p99']} → {t['api_beside_p50_p99']} ms, as the engine worker did "
           f"{t['engine_alone_p50_p99']} → {t['engine_beside_p50_p99']} ms")
    return t


async def run_arm(base_url: str, keys: dict[str, str], engine_url: str, engine_headers: dict[str, str], db_url: str,
                  model: str, log: Callable[[str], None], parts: tuple[str, ...], **kw) -> dict:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        probe = Tenant("short", keys["short"], 1, 1)
        await Load(http, model, 0).one(probe, 1, 4)  # also the engine's first (slow) request
        template = int(probe.events[0][1] / W_IN) - 1 if probe.events else 0
        sc = Scene(http, keys, engine_url, engine_headers, db_url, Load(http, model, template), log)
        out: dict = dict(template_tokens=template)
        if "backlog" in parts:
            out["backlog"] = await backlog(sc, kw["seconds"], kw["window"], kw["streams"], kw["prompt"],
                                           kw["out_tokens"])
        if "giants" in parts:
            out["ttft"] = await giant_prompts(sc, kw["seconds"] / 2, kw["rate"], kw["prompt"], kw["giant"],
                                              kw["giant_streams"])
        return out


def main(settings: Settings, seconds: float = 20.0, window: float = 5.0, max_num_seqs: int = 8,
         streams: dict[str, int] | None = None, rate: float = 4.0, prompt: int = 64, out_tokens: int = 32,
         arms: tuple[str, ...] = ("fcfs", "vtc"), parts: tuple[str, ...] = ("backlog", "giants"),
         log: Callable[[str], None] = print) -> int:
    streams = streams or dict(short=8 * max_num_seqs, long=2 * max_num_seqs)
    giant = settings.max_model_len - 64
    log(f"bench fairness: {max_num_seqs} sequence slots, 2 tenants of weight 1 with {streams} streams, "
        f"{seconds:.0f} s backlog ({window:.0f} s windows), requests {prompt}+{out_tokens} vs "
        f"{10 * prompt}+{10 * out_tokens} tokens; then TTFT at {rate}/s beside {giant}-token prompts")
    figures: dict[str, dict] = {}
    for arm in arms:
        log(f"arm {arm}:")
        with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, \
                ballast_up(settings, Path(d), BALLAST_MAX_NUM_SEQS=str(max_num_seqs), BALLAST_FAIR_SHARE=arm) as st:
            db_url = owner_url(st.db_url, Path(d))
            keys, engine_url = asyncio.run(make_tenants(db_url, ["short", "long"]))
            figures[arm] = asyncio.run(run_arm(
                str(st.api.base_url), keys, engine_url, st.engine_headers, db_url, settings.model_name, log, parts,
                seconds=seconds, window=window, streams=streams, rate=rate, prompt=prompt, out_tokens=out_tokens,
                giant=giant, giant_streams=2 * max_num_seqs))
    keep = ("jain_min", "jain_median", "max_service_diff", "backlogged_diff", "bound", "stretches",
            "stretches_over_bound", "stretch_s", "worst_stretch", "both_waiting", "both_waiting_per_window",
            "jain_min_backlogged", "backlogged_windows", "waiting_share", "outstanding_min", "tokens_per_event",
            "merged_responses", "scheduler", "tokens_per_s", "requests", "dropped", "ttft_p50_p99")
    out = dict(bench="fairness", weights="input + 2 x output tokens", max_num_seqs=max_num_seqs, streams=streams,
               seconds=seconds, window_s=window,
               requests=dict(short=[prompt, out_tokens], long=[10 * prompt, 10 * out_tokens], giant=[giant, 16]),
               **{arm: dict(**{k: f["backlog"][k] for k in keep if "backlog" in f},
                            **({} if "ttft" not in f else dict(
                                ttft_p99_alone_ms=f["ttft"]["alone_p99"], ttft_p99_giants_ms=f["ttft"]["giant_p99"],
                                ttft_p99_ratio=f["ttft"]["p99_ratio"],
                                giant_tokens_per_s=f["ttft"]["giant_tokens_per_s"],
                                **{k: v for k, v in f["ttft"].items() if k.endswith("_p50_p99")})))
                  for arm, f in figures.items()})
    if "backlog" in parts:
        draw_fairness(PICTURE, {arm: dict(tenants=f["backlog"]["series"]) for arm, f in figures.items()},
                      f"bench fairness: two tenants of weight 1 backlogged on {max_num_seqs} slots, one's requests "
                      f"10x the other's ({prompt}+{out_tokens} vs {10 * prompt}+{10 * out_tokens} tokens)")
        log(f"picture: {PICTURE}")
    print(json.dumps(out))
    return 0
