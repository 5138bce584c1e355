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
  ballast_priced  the same, coming back after a wait priced from the engine's recent
             calm spells and what its resumptions cost (BALLAST_BATCH_RESUME=priced,
             policy.preemption.resume_after);
  priority   vLLM's priority scheduling alone: batch goes in at low priority and keeps
             every slot it holds, no preemption, no cap (BALLAST_BATCH_PREEMPTION=false);
  partition  a static partition: batch never holds more than half the slots, busy or not
             (BALLAST_BATCH_MAX_SHARE=0.5, no busy cap).

In each batch arm the backlog first runs alone for a while: its rate then is the engine's
batch capacity. Then the interactive arrivals play: calm, a surge at five times the rate,
calm again. That plan plays ROUNDS times per arm, each round its own seed (the same seeds
in every arm), back to back on the same stack, and the rounds are pooled: ~540 requests,
so that p99 is not the slowest one or two. Batch progress is read from the journal (the
tokens of the chunks committed during each round's window, the preemptions recorded there),
once every transaction that began in a window has ended. Harvest is the batch
rate during the window over the capacity left idle by interactive work (capacity × the
share of the window with no interactive request in flight); capacity is the median of the
uncapped arms' (ballast, priority), so every arm is held to the same yardstick. Re-
prefilled tokens are those a preempted item sends again on resume (its prompt and what it
had generated), an upper bound: vLLM's prefix cache serves part of them.

Each ratio to alone (TTFT p50 and p99, mean TPOT) comes with a bootstrap 95 % interval
(bench/stats.py) that resamples whole bursts: the requests of a burst arrive together and
share their fate. A target is "met" only where the whole interval is on its side, "not
met" where the whole interval is beyond it, else "undecided". One JSON line last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.batch import ALPHABET
from bench.pictures import draw_surge
from bench.stack import Stack, ballast_up
from bench.stats import mean, p50, p99, pct, ratio_ci
from config import Settings

SEED = 11
PICTURE = Path(__file__).with_name("surge.png")
ROUNDS = 4  # plays of the arrivals per arm, pooled
MAX_TOKENS = 64  # per chat request
# Backlog items per second of an arm (its batch-alone phase and every round): enough on an
# engine that runs the batch at 9,600 tok/s (50 items of 192 tokens on average) throughout.
BATCH_ITEMS_PER_S = 50
CAPACITY_S = (5.0, 20.0)  # batch alone: the window, after its first commit, its rate is read in
WARM_EVERY_S = 0.25  # alone: a one-token request this often keeps vLLM from parking (it spins 1 s)
ARMS: dict[str, dict[str, str]] = {
    "alone": {},
    "ballast": {},
    "ballast_priced": dict(BALLAST_BATCH_RESUME="priced"),
    "priority": dict(BALLAST_BATCH_PREEMPTION="false"),
    "partition": dict(BALLAST_BATCH_MAX_SHARE="0.5", BALLAST_BATCH_BUSY_CAP="1000000", BALLAST_SURGE_BATCH_SHARE="0.5"),
}


def arrivals(seconds: float, rate: float, seed: int = SEED) -> list[tuple[float, int, str]]:
    """(offset, burst, prompt): bursts of 1-4 requests, Poisson at `rate` bursts/s; the
    middle third of the window surges at five times that."""
    rng = random.Random(seed)
    out: list[tuple[float, int, str]] = []
    t, burst = 0.0, 0
    while True:
        surging = seconds / 3 <= t < 2 * seconds / 3
        t += rng.expovariate(rate * (5 if surging else 1))
        if t >= seconds:
            return out
        for _ in range(rng.choice((1, 1, 2, 4))):
            words = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(20, 200)))
            out.append((t, burst, f"Question {len(out)}: {words}"))
        burst += 1


def backlog_items(seconds: float, rounds: int) -> int:
    return math.ceil(BATCH_ITEMS_PER_S * (CAPACITY_S[1] + rounds * seconds + 30))


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
    burst: tuple[int, int] = (0, 0)  # (round, burst): the requests that arrived together

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Arm:
    name: str
    chats: list[Chat] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)  # each round's load, wall clock
    capacity: float | None = None  # batch tokens/s alone, in this arm's stack
    batch: list[dict[str, Any]] = field(default_factory=list)  # from the journal, per round's window
    batch_slots: list[int] = field(default_factory=list)  # batch holds on the engine, sampled
    picture: dict[str, Any] = field(default_factory=dict)  # its first round, as bench/pictures.py draws it

    def idle_share(self, r: int) -> float:
        """The share of round r's window with no interactive request in flight."""
        w0, w1 = self.windows[r]
        busy, until = 0.0, w0
        for c in sorted((c for c in self.chats if c.burst[0] == r), key=lambda c: c.start):
            if c.end > until:
                busy += c.end - max(c.start, until)
                until = c.end
        return max(0.0, 1 - busy / (w1 - w0))


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


async def play(http: httpx.AsyncClient, model: str, plan: list[tuple[float, int, str]], r: int) -> list[Chat]:
    t0 = time.time()
    tasks, bursts = [], []
    for offset, burst, prompt in plan:
        await asyncio.sleep(max(0.0, t0 + offset - time.time()))
        tasks.append(asyncio.create_task(chat(http, model, prompt)))
        bursts.append((r, burst))
    return [dataclasses.replace(c, burst=b) for c, b in zip(await asyncio.gather(*tasks), bursts, strict=True)]


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


def still_running(stack: Stack, batch_id: str) -> None:
    """The backlog lasted the whole arm: a batch that ran out before the last window ended
    would leave that window's harvest understated."""
    b = stack.api.get(f"/v1/batches/{batch_id}").raise_for_status().json()
    counts = b.get("request_counts") or {}
    if b["status"] != "in_progress" or counts.get("completed", 0) + counts.get("failed", 0) >= counts.get("total", 1):
        raise RuntimeError(f"the batch backlog ran out before the interactive load ended ({b['status']}, {counts}): "
                           "raise BATCH_ITEMS_PER_S")


def journal(db_url: str, sql: str, *args) -> Any:
    import psycopg

    with psycopg.connect(db_url) as conn:
        return conn.execute(sql, args).fetchone()


def settled(db_url: str, t: float, timeout_s: float = 30) -> None:
    """Wait until every transaction that began before `t` (unix seconds) has ended.

    An event's committed_at is its transaction's start, so a chunk stamped inside a window
    can commit after the window's end; once no transaction that began before the end is
    open, a read of the window has all of them. An error naming those still open otherwise."""
    import psycopg

    q = ("SELECT pid, state, xact_start, left(query, 80) FROM pg_stat_activity"
         " WHERE xact_start < to_timestamp(%s) AND backend_type = 'client backend'"
         " AND datname = current_database() AND pid <> pg_backend_pid()")
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(db_url, autocommit=True) as conn:
        while (open_ := conn.execute(q, (t,)).fetchall()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"transactions begun before {t:.3f} still open after {timeout_s:.0f} s, the "
                                   f"window's chunks could be missing: {open_}")
            time.sleep(0.2)


def chunk_tokens(db_url: str, t0: float, t1: float) -> int:
    settled(db_url, t1)
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

    tokens = chunk_tokens(db_url, t0, t1)  # waits for the window's transactions to end
    with psycopg.connect(db_url) as conn:
        preempted = conn.execute("SELECT (payload->>'idx')::int, (payload->>'offset')::int FROM events"
                                 " WHERE type = 'item_preempted' AND committed_at >= to_timestamp(%s)"
                                 " AND committed_at < to_timestamp(%s)", (t0, t1)).fetchall()
        surges = conn.execute("SELECT count(*) FROM events WHERE type = 'surge_started'"
                              " AND committed_at >= to_timestamp(%s) AND committed_at < to_timestamp(%s)",
                              (t0, t1)).fetchone()
    return dict(tokens=tokens, preemptions=len(preempted),
                reprefill_tokens=sum(prompt_tokens[idx] + offset for idx, offset in preempted),
                fleet_surges=surges[0] if surges else 0)


def run_arm(settings: Settings, name: str, plans: list[list[tuple[float, int, str]]], prompt_tokens: list[int],
            reqs: list[dict], log=print) -> Arm:
    arm = Arm(name)
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, \
            ballast_up(settings, Path(d), **ARMS[name]) as stack:
        engine_url = journal(stack.db_url, "SELECT url FROM engines LIMIT 1")[0]
        batch_id: list[str] = []

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
                for r, plan in enumerate(plans):
                    t0 = time.time()
                    arm.chats += await play(http, settings.model_name, plan, r)
                    arm.windows.append((t0, time.time()))
                    log(f"  {name}: round {r + 1} of {len(plans)}, {len(plan)} chats in {time.time() - t0:.0f} s")
                stop.set()
                await asyncio.gather(*background)

        def batch_phase() -> None:
            batch_id.append(submit_batch(stack, settings.model_name, reqs))
            start = first_commit(stack.db_url)
            time.sleep(max(0.0, start + CAPACITY_S[1] - time.time()))
            a, b = start + CAPACITY_S[0], start + CAPACITY_S[1]
            arm.capacity = chunk_tokens(stack.db_url, a, b) / (b - a)
            log(f"  {name}: batch alone {arm.capacity:.0f} tok/s")

        asyncio.run(interactive())
        arm.picture = first_round(stack.db_url, arm)
        if name != "alone":
            still_running(stack, batch_id[0])
            arm.batch = [batch_in_window(stack.db_url, w0, w1, prompt_tokens) for w0, w1 in arm.windows]
    return arm


def first_round(db_url: str, arm: Arm) -> dict[str, Any]:
    """The arm's first round for its picture: each chat's TTFT where it arrived, the batch
    tokens the journal committed per second, and the fleet controller's surges (their
    journaled starts and ends), in seconds from the round's start."""
    import psycopg

    w0, w1 = arm.windows[0]
    settled(db_url, w1)
    with psycopg.connect(db_url) as conn:
        tokens = conn.execute("SELECT floor(extract(epoch FROM committed_at) - %s)::int, "
                              "sum(jsonb_array_length(payload->'token_ids')) FROM events WHERE type = 'item_chunk' "
                              "AND committed_at >= to_timestamp(%s) AND committed_at < to_timestamp(%s) GROUP BY 1 "
                              "ORDER BY 1", (w0, w0, w1)).fetchall()
        marks = conn.execute("SELECT stream, type, extract(epoch FROM committed_at)::float FROM events "
                             "WHERE type IN ('surge_started', 'surge_ended') AND committed_at < to_timestamp(%s) "
                             "ORDER BY position", (w1,)).fetchall()
    surges: list[tuple[float, float]] = []
    open_: dict[str, float] = {}
    for stream, kind, at in marks:
        if kind == "surge_started":
            open_.setdefault(stream, at)
        elif stream in open_:
            surges.append((open_.pop(stream), at))
    surges += [(at, w1) for at in open_.values()]
    return dict(seconds=w1 - w0, chats=[(c.start - w0, c.first - c.start) for c in arm.chats if c.burst[0] == 0],
                tokens=[(t, int(n)) for t, n in tokens],
                surges=[(max(a, w0) - w0, min(b, w1) - w0) for a, b in surges if b > w0])


def _ratios(a: Arm, alone: Arm) -> dict[str, Any]:
    """TTFT p50, p99 and mean TPOT over alone's, each with its interval (whole bursts resampled)."""
    ttft = [c.first - c.start for c in a.chats]
    ttft_alone = [c.first - c.start for c in alone.chats]
    tpot = [(c.tpot, c.burst) for c in a.chats if c.tpot is not None]
    tpot_alone = [(c.tpot, c.burst) for c in alone.chats if c.tpot is not None]
    groups = ([c.burst for c in a.chats], [c.burst for c in alone.chats])
    return dict(
        ttft_p50_ratio=ratio_ci(ttft, ttft_alone, p50, groups=groups).as_dict(),
        ttft_p99_ratio=ratio_ci(ttft, ttft_alone, p99, groups=groups).as_dict(),
        tpot_ratio=ratio_ci([t for t, _ in tpot], [t for t, _ in tpot_alone], mean,
                            groups=([b for _, b in tpot], [b for _, b in tpot_alone])).as_dict())


def summarise(arms: dict[str, Arm]) -> dict:
    capacity = p50(arms[n].capacity or 0.0 for n in ("ballast", "priority") if n in arms)
    out: dict[str, Any] = dict(batch_capacity_tokens_per_s=round(capacity, 1))
    for n, a in arms.items():
        ttft = [c.first - c.start for c in a.chats]
        tpots = [c.tpot for c in a.chats if c.tpot is not None]
        seconds = [w1 - w0 for w0, w1 in a.windows]
        r: dict[str, Any] = dict(
            requests=len(a.chats), rounds=len(a.windows), bursts=len({c.burst for c in a.chats}),
            ttft_p50_ms=round(1000 * pct(ttft, 50), 1), ttft_p99_ms=round(1000 * pct(ttft, 99), 1),
            tpot_ms=round(1000 * mean(tpots), 2),
            idle_share=round(sum(a.idle_share(i) * s for i, s in enumerate(seconds)) / sum(seconds), 3),
            seconds=round(sum(seconds), 1))
        if n != "alone":
            r.update(_ratios(a, arms["alone"]))
        if a.batch:
            tokens = sum(b["tokens"] for b in a.batch)
            idle = [capacity * a.idle_share(i) * s for i, s in enumerate(seconds)]  # tokens it could have run
            r.update(batch_tokens_per_s=round(tokens / sum(seconds), 1), harvest_of_idle=round(tokens / sum(idle), 3),
                     harvest_by_round=[round(b["tokens"] / i, 3) for b, i in zip(a.batch, idle, strict=True)],
                     batch_alone_tokens_per_s=round(a.capacity or 0, 1),
                     preemptions=sum(b["preemptions"] for b in a.batch),
                     reprefill_tokens=sum(b["reprefill_tokens"] for b in a.batch),
                     fleet_surges=sum(b["fleet_surges"] for b in a.batch),
                     batch_slots_max=max(a.batch_slots, default=0),
                     batch_slots_mean=round(statistics.mean(a.batch_slots), 1) if a.batch_slots else 0)
        out[n] = r
    if "ballast" in arms:  # ballast's TTFT p99 against each comparison arm's, for the verdict
        b = [c.first - c.start for c in arms["ballast"].chats]
        for o in ("priority", "partition"):
            if o in arms:
                other = [c.first - c.start for c in arms[o].chats]
                groups = ([c.burst for c in arms["ballast"].chats], [c.burst for c in arms[o].chats])
                out["ballast"][f"ttft_p99_vs_{o}"] = ratio_ci(b, other, p99, groups=groups).as_dict()
    return out


def judged(ratio: dict, bound: float) -> str:
    """A target `ratio ≤ bound`, read with the ratio's interval."""
    lo, hi = ratio["ci95"]
    return "met" if hi <= bound else "not met" if lo > bound else "undecided"


def verdict(out: dict) -> dict:
    b = out["ballast"]
    better = {}
    for o in ("priority", "partition"):
        if o in out:
            lo, hi = b[f"ttft_p99_vs_{o}"]["ci95"]
            harvest, theirs = b["harvest_of_idle"], out[o]["harvest_of_idle"]
            # Better on one of (TTFT p99, harvest) and no worse on the other: p99 "better" only
            # where its whole interval is below theirs, "no worse" unless it is wholly above.
            better[o] = (hi < 1 and harvest >= theirs) or (harvest > theirs and lo <= 1)
    return dict(ttft_p99_le_1_10=judged(b["ttft_p99_ratio"], 1.10), tpot_le_1_05=judged(b["tpot_ratio"], 1.05),
                harvest_ge_0_6=b["harvest_of_idle"] >= 0.6, better_than=better)


def _ci(r: dict) -> str:
    return f"{r['ratio']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"


def main(settings: Settings, duration_s: float = 90.0, rate: float = 0.3, arms: list[str] | None = None,
         rounds: int = ROUNDS) -> int:
    from transformers import AutoTokenizer

    from engine.model_spec import resolve_model

    names = [n for n in ARMS if arms is None or n in arms]  # alone and ballast always: the ratios need them
    names = sorted({"alone", "ballast", *names}, key=list(ARMS).index)
    plans = [arrivals(duration_s, rate, SEED + r) for r in range(rounds)]
    reqs = backlog(backlog_items(duration_s, rounds))
    tok = AutoTokenizer.from_pretrained(resolve_model(settings).path)
    prompt_tokens = [len(tok(r["prompt"])["input_ids"]) for r in reqs]
    print(f"bench surge: {rounds} rounds of {duration_s:.0f} s per arm, {sum(map(len, plans))} streamed chat requests "
          f"in all (bursts at {rate}/s, ×5 in the middle third of each round), {MAX_TOKENS} tokens each; a "
          f"{len(reqs)}-item batch backlog; arms {', '.join(names)}, each a fresh `ballast up`", flush=True)
    ran = {}
    for name in names:
        print(f"arm {name} …", flush=True)
        ran[name] = run_arm(settings, name, plans, prompt_tokens, reqs)
    out: dict[str, Any] = dict(bench="surge", seconds=duration_s, rounds=rounds, burst_rate=rate,
                               chat_requests=sum(map(len, plans)), max_tokens=MAX_TOKENS, **summarise(ran))
    out["targets"] = verdict(out)
    # The picture's data stays in the JSON line, so the picture can be drawn again from it.
    out["picture"] = {n: dict(a.picture, load_surge=(duration_s / 3, 2 * duration_s / 3)) for n, a in ran.items()}
    draw_surge(PICTURE, out["picture"],
               f"bench surge: chat bursts over a batch backlog, the first round of {duration_s:.0f} s per arm "
               f"(batch alone: {out['batch_capacity_tokens_per_s']} tok/s)")
    print(f"\nbatch capacity (alone): {out['batch_capacity_tokens_per_s']} tok/s; ratios to alone with 95 % intervals")
    print(f"{'arm':10} {'n':>4} {'TTFT p50':>9} {'p99':>9} {'TPOT':>7} {'p50×':>18} {'p99×':>18} {'TPOT×':>18} "
          f"{'batch tok/s':>11} {'harvest':>8} {'preempt':>8} {'re-prefill':>10}")
    for name in names:
        a = out[name]
        ratios = [_ci(a[k]) if k in a else "1" for k in ("ttft_p50_ratio", "ttft_p99_ratio", "tpot_ratio")]
        print(f"{name:10} {a['requests']:4d} {a['ttft_p50_ms']:7.1f}ms {a['ttft_p99_ms']:7.1f}ms {a['tpot_ms']:5.2f}ms "
              f"{ratios[0]:>18} {ratios[1]:>18} {ratios[2]:>18} "
              f"{a.get('batch_tokens_per_s', '-'):>11} {a.get('harvest_of_idle', '-'):>8} "
              f"{a.get('preemptions', '-'):>8} {a.get('reprefill_tokens', '-'):>10}")
    print(f"targets: {out['targets']}")
    print(f"picture: {PICTURE}")
    print(json.dumps(out))
    return 0
