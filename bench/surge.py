"""`ballast bench surge`: interactive traffic surging over a batch backlog, through the
real path, as shipped.

Every arm is a fresh `ballast up` on default settings: interactive load is streamed chat
through the API, batch is one large file through the Batches API (REST → batch workflow
→ engine worker → journal), the fleet controller is on. The arms see the same seeded
arrivals and differ only in how batch yields:

  alone      interactive load only, the engine kept hot by a one-token request every
             0.25 s straight to the engine worker (batch keeps the other arms' hot), so
             "alone" is not slowed by vLLM waking from idle: the reference for TTFT, TPOT;
  ballast    defaults: batch is preempted while interactive work is in flight and comes
             back after the cool-down (engine/slots.py, policy/preemption.py);
  priority   vLLM's priority scheduling alone: batch goes in at low priority and keeps
             every slot it holds, no preemption, no cap (BALLAST_BATCH_PREEMPTION=false);
  partition  a static partition: batch never holds more than half the slots, busy or not
             (BALLAST_BATCH_MAX_SHARE=0.5, no busy cap).

In each batch arm the backlog first runs alone for a while: its rate then is the engine's
batch capacity. Then the interactive arrivals play: calm, a surge at five times the rate,
calm again. Batch progress is read from the journal (the tokens of the chunks committed
during the interactive window, the preemptions recorded there). Harvest is the batch
rate during the window over the capacity left idle by interactive work (capacity × the
share of the window with no interactive request in flight); capacity is the median of the
uncapped arms' (ballast, priority), so every arm is held to the same yardstick. Re-
prefilled tokens are those a preempted item sends again on resume (its prompt and what it
had generated), an upper bound: vLLM's prefix cache serves part of them. One JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ballast.settings import Settings
from bench.batch import ALPHABET
from bench.stack import Stack, ballast_up

SEED = 11
MAX_TOKENS = 64  # per chat request
BATCH_ITEMS = 4000  # enough backlog for the whole arm on an engine twice this one's speed
CAPACITY_S = (5.0, 20.0)  # batch alone: the window, after its first commit, its rate is read in
WARM_EVERY_S = 0.25  # alone: a one-token request this often keeps vLLM from parking (it spins 1 s)
ARMS: dict[str, dict[str, str]] = {
    "alone": {},
    "ballast": {},
    "priority": dict(BALLAST_BATCH_PREEMPTION="false"),
    "partition": dict(BALLAST_BATCH_MAX_SHARE="0.5", BALLAST_BATCH_BUSY_CAP="1000000", BALLAST_SURGE_BATCH_SHARE="0.5"),
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def arrivals(seconds: float, rate: float, seed: int = SEED) -> list[tuple[float, str]]:
    """(offset, prompt): bursts of 1-4 requests, Poisson at `rate` bursts/s; the middle
    third of the window surges at five times that."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        surging = seconds / 3 <= t < 2 * seconds / 3
        t += rng.expovariate(rate * (5 if surging else 1))
        if t >= seconds:
            return out
        for _ in range(rng.choice((1, 1, 2, 4))):
            words = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(20, 200)))
            out.append((t, f"Question {len(out)}: {words}"))


def backlog(n: int, seed: int = SEED) -> list[dict]:
    """n completions: prompts of 100-300 tokens, 128-256 output tokens each."""
    rng = random.Random(seed + 1)
    return [dict(prompt="".join(rng.choice(ALPHABET) for _ in range(rng.randint(100, 300))),
                 max_tokens=rng.randint(128, 256), temperature=0, ignore_eos=True) for _ in range(n)]


@dataclass
class Chat:
    start: float
    first: float
    end: float
    tokens: int


@dataclass
class Arm:
    name: str
    chats: list[Chat] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)  # the interactive load's, wall clock
    capacity: float | None = None  # batch tokens/s alone, in this arm's stack
    batch: dict[str, Any] = field(default_factory=dict)  # from the journal, over the window
    batch_slots: list[int] = field(default_factory=list)  # batch holds on the engine, sampled

    @property
    def idle_share(self) -> float:
        """The share of the window with no interactive request in flight."""
        busy, until = 0.0, self.window[0]
        for c in sorted(self.chats, key=lambda c: c.start):
            if c.end > until:
                busy += c.end - max(c.start, until)
                until = c.end
        return max(0.0, 1 - busy / (self.window[1] - self.window[0]))


async def chat(http: httpx.AsyncClient, model: str, prompt: str) -> Chat:
    body = dict(model=model, messages=[dict(role="user", content=prompt)], max_tokens=MAX_TOKENS, temperature=0,
                ignore_eos=True, stream=True, stream_options=dict(include_usage=True))
    t0 = time.time()
    first: float | None = None
    n = 0  # as the usage chunk counts them: a chunk may carry several tokens
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat answered {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.time()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    assert first is not None and n, f"no content (or no usage) streamed back for {prompt[:40]!r}"
    return Chat(t0, first, time.time(), n)


async def play(http: httpx.AsyncClient, model: str, plan: list[tuple[float, str]]) -> list[Chat]:
    t0 = time.time()
    tasks = []
    for offset, prompt in plan:
        await asyncio.sleep(max(0.0, t0 + offset - time.time()))
        tasks.append(asyncio.create_task(chat(http, model, prompt)))
    return list(await asyncio.gather(*tasks))


async def keep_warm(stack: Stack, url: str, model: str, stop: asyncio.Event) -> None:
    """The alone arm's engine kept hot, as batch keeps the others': a one-token request
    straight to the engine worker every WARM_EVERY_S, so that a chat after a quiet gap
    does not also pay vLLM's wake-up from idle (its workers stop spinning after 1 s)."""
    job = dict(endpoint="/v1/completions", priority=0, tenant="warm", tier="default", weight=1,
               body=dict(model=model, prompt="warm", max_tokens=1))
    async with httpx.AsyncClient(headers=stack.engine_headers, timeout=10) as http:
        n = 0
        while not stop.is_set():
            (await http.post(url + "/v1/generate", json=dict(job, request_id=f"warm-{n}"))).raise_for_status()
            n += 1
            await asyncio.sleep(WARM_EVERY_S)


async def sample_slots(stack: Stack, url: str, out: list[int], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(headers=stack.engine_headers, timeout=5) as http:
        while not stop.is_set():
            out.append((await http.get(url + "/stats")).json()["batch"])
            await asyncio.sleep(0.1)


def submit_batch(stack: Stack, model: str, reqs: list[dict]) -> str:
    lines = "".join(json.dumps(dict(custom_id=f"s{i}", method="POST", url="/v1/completions",
                                    body=dict(r, model=model))) + "\n" for i, r in enumerate(reqs)).encode()
    fid = stack.api.post("/v1/files", files={"file": ("surge.jsonl", lines)},
                         data={"purpose": "batch"}).raise_for_status().json()["id"]
    return stack.api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/completions",
                                                   completion_window="24h")).raise_for_status().json()["id"]


def journal(db_url: str, sql: str, *args) -> Any:
    import psycopg

    with psycopg.connect(db_url) as conn:
        return conn.execute(sql, args).fetchone()


def chunk_tokens(db_url: str, t0: float, t1: float) -> int:
    row = journal(db_url, "SELECT coalesce(sum(jsonb_array_length(payload->'token_ids')), 0) FROM events"
                          " WHERE type = 'item_chunk' AND committed_at >= to_timestamp(%s)"
                          " AND committed_at < to_timestamp(%s)", t0, t1)
    return int(row[0])


def first_commit(db_url: str, timeout_s: float = 120) -> float:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        row = journal(db_url, "SELECT extract(epoch FROM min(committed_at))::float FROM events"
                              " WHERE type = 'item_chunk'")
        if row[0] is not None:
            return row[0]
        time.sleep(0.2)
    raise RuntimeError("the batch wrote no checkpoint in time: see the stack's logs")


def batch_in_window(db_url: str, t0: float, t1: float, prompt_tokens: list[int]) -> dict:
    import psycopg

    with psycopg.connect(db_url) as conn:
        preempted = conn.execute("SELECT (payload->>'idx')::int, (payload->>'offset')::int FROM events"
                                 " WHERE type = 'item_preempted' AND committed_at >= to_timestamp(%s)"
                                 " AND committed_at < to_timestamp(%s)", (t0, t1)).fetchall()
        surges = conn.execute("SELECT count(*) FROM events WHERE type = 'surge_started'"
                              " AND committed_at >= to_timestamp(%s) AND committed_at < to_timestamp(%s)",
                              (t0, t1)).fetchone()
    return dict(tokens=chunk_tokens(db_url, t0, t1), preemptions=len(preempted),
                reprefill_tokens=sum(prompt_tokens[idx] + offset for idx, offset in preempted),
                fleet_surges=surges[0] if surges else 0)


def run_arm(settings: Settings, name: str, plan: list[tuple[float, str]], prompt_tokens: list[int],
            reqs: list[dict], log=print) -> Arm:
    arm = Arm(name)
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, \
            ballast_up(settings, Path(d), **ARMS[name]) as stack:
        engine_url = journal(stack.db_url, "SELECT url FROM engines LIMIT 1")[0]

        async def interactive() -> None:
            async with httpx.AsyncClient(base_url=str(stack.api.base_url), headers=dict(stack.api.headers),
                                         timeout=120) as http:
                for i in range(3):  # the engine and the path warm
                    await chat(http, settings.model_name, f"warm up {i}")
                if name != "alone":
                    await asyncio.to_thread(batch_phase)
                stop = asyncio.Event()
                background = [asyncio.create_task(sample_slots(stack, engine_url, arm.batch_slots, stop))]
                if name == "alone":
                    background.append(asyncio.create_task(keep_warm(stack, engine_url, settings.model_name, stop)))
                t0 = time.time()
                arm.chats = await play(http, settings.model_name, plan)
                arm.window = (t0, time.time())
                stop.set()
                await asyncio.gather(*background)

        def batch_phase() -> None:
            submit_batch(stack, settings.model_name, reqs)
            start = first_commit(stack.db_url)
            time.sleep(max(0.0, start + CAPACITY_S[1] - time.time()))
            a, b = start + CAPACITY_S[0], start + CAPACITY_S[1]
            time.sleep(1.5)  # the checkpoints of the window's last second land
            arm.capacity = chunk_tokens(stack.db_url, a, b) / (b - a)
            log(f"  {name}: batch alone {arm.capacity:.0f} tok/s")

        asyncio.run(interactive())
        if name != "alone":
            time.sleep(1.5)
            arm.batch = batch_in_window(stack.db_url, *arm.window, prompt_tokens)
    return arm


def summarise(arms: dict[str, Arm]) -> dict:
    ttft = {n: [c.first - c.start for c in a.chats] for n, a in arms.items()}
    tpot = {n: statistics.mean((c.end - c.first) / (c.tokens - 1) for c in a.chats if c.tokens > 1)
            for n, a in arms.items()}
    capacity = statistics.median(arms[n].capacity or 0.0 for n in ("ballast", "priority") if n in arms)
    out: dict[str, Any] = dict(batch_capacity_tokens_per_s=round(capacity, 1))
    for n, a in arms.items():
        seconds = a.window[1] - a.window[0]
        r: dict[str, Any] = dict(
            requests=len(a.chats), ttft_p50_ms=round(1000 * pct(ttft[n], 50), 1),
            ttft_p99_ms=round(1000 * pct(ttft[n], 99), 1), tpot_ms=round(1000 * tpot[n], 2),
            ttft_p50_ratio=round(pct(ttft[n], 50) / pct(ttft["alone"], 50), 3),
            ttft_p99_ratio=round(pct(ttft[n], 99) / pct(ttft["alone"], 99), 3),
            tpot_ratio=round(tpot[n] / tpot["alone"], 3), idle_share=round(a.idle_share, 3),
            seconds=round(seconds, 1))
        if a.batch:
            rate = a.batch["tokens"] / seconds
            r.update(batch_tokens_per_s=round(rate, 1), harvest_of_idle=round(rate / (capacity * a.idle_share), 3),
                     batch_alone_tokens_per_s=round(a.capacity or 0, 1), preemptions=a.batch["preemptions"],
                     reprefill_tokens=a.batch["reprefill_tokens"], fleet_surges=a.batch["fleet_surges"],
                     batch_slots_max=max(a.batch_slots, default=0),
                     batch_slots_mean=round(statistics.mean(a.batch_slots), 1) if a.batch_slots else 0)
        out[n] = r
    return out


def verdict(out: dict) -> dict:
    b = out["ballast"]
    better = {o: (b["ttft_p99_ms"] < out[o]["ttft_p99_ms"] and b["harvest_of_idle"] >= out[o]["harvest_of_idle"])
             or (b["harvest_of_idle"] > out[o]["harvest_of_idle"] and b["ttft_p99_ms"] <= out[o]["ttft_p99_ms"])
             for o in ("priority", "partition") if o in out}
    return dict(ttft_p99_le_1_10=b["ttft_p99_ratio"] <= 1.10, tpot_le_1_05=b["tpot_ratio"] <= 1.05,
                harvest_ge_0_6=b["harvest_of_idle"] >= 0.6, better_than=better)


def main(settings: Settings, duration_s: float = 90.0, rate: float = 0.3, arms: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from engine.models import resolve_model

    names = [n for n in ARMS if arms is None or n in arms]  # alone and ballast always: the ratios need them
    names = sorted({"alone", "ballast", *names}, key=list(ARMS).index)
    plan = arrivals(duration_s, rate)
    reqs = backlog(BATCH_ITEMS)
    tok = AutoTokenizer.from_pretrained(resolve_model(settings).path)
    prompt_tokens = [len(tok(r["prompt"])["input_ids"]) for r in reqs]
    print(f"bench surge: {len(plan)} streamed chat requests over {duration_s:.0f} s (bursts at {rate}/s, ×5 in the "
          f"middle third), {MAX_TOKENS} tokens each; a {len(reqs)}-item batch backlog; arms {', '.join(names)}, "
          f"each a fresh `ballast up`", flush=True)
    ran = {}
    for name in names:
        print(f"arm {name} …", flush=True)
        ran[name] = run_arm(settings, name, plan, prompt_tokens, reqs)
    out: dict[str, Any] = dict(bench="surge", seconds=duration_s, burst_rate=rate, chat_requests=len(plan),
                               max_tokens=MAX_TOKENS, **summarise(ran))
    out["targets"] = verdict(out)
    print(f"\nbatch capacity (alone): {out['batch_capacity_tokens_per_s']} tok/s")
    print(f"{'arm':10} {'n':>4} {'TTFT p50':>9} {'p99':>8} {'TPOT':>7} {'p50×':>6} {'p99×':>6} {'TPOT×':>6} "
          f"{'batch tok/s':>11} {'harvest':>8} {'preempt':>8} {'re-prefill':>10}")
    for name in names:
        a = out[name]
        print(f"{name:10} {a['requests']:4d} {a['ttft_p50_ms']:7.1f}ms {a['ttft_p99_ms']:6.1f}ms {a['tpot_ms']:5.2f}ms "
              f"{a['ttft_p50_ratio']:6.2f} {a['ttft_p99_ratio']:6.2f} {a['tpot_ratio']:6.2f} "
              f"{a.get('batch_tokens_per_s', '-'):>11} {a.get('harvest_of_idle', '-'):>8} "
              f"{a.get('preemptions', '-'):>8} {a.get('reprefill_tokens', '-'):>10}")
    print(f"targets: {out['targets']}")
    print(json.dumps(out))
    return 0
