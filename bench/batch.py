"""`ballast bench batch`: the same batches through raw vLLM and through Ballast.

Arm 1 (baseline): every request submitted at once to an in-process vLLM AsyncLLM.
Arm 2 (Ballast): the same requests as a JSONL file through `ballast up` end to end —
REST upload → batch workflow → engine worker → journal checkpoints → output file — on
default settings. Same model, engine settings and requests; each arm's engine is warm
(start-up is not counted).

Both arms place their processes alike: on a CPU engine, off the cores vLLM binds its
model worker to (ballast/affinity.py; BALLAST_ISOLATE_ENGINE_CPUS=false turns it off in
both). Two batches: the short one (`requests` completions, 256 by default) and a long one sized
so that the raw arm runs at least `long_s` seconds. `runs` rounds, alternating raw and
Ballast, each with its own engine or stack; the ratio is of the medians. A Ballast batch
ends when the journal records it completed (the batch's status event), so the client's
polling interval does not count. CPU per process is sampled from /proc throughout and
reported per 1,000 output tokens; the last round's short batch is drawn (vLLM's running
and waiting sequences, when each item reached vLLM and left it, activity starts,
checkpoint commits, CPU per process) into `picture`. One JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from ballast import affinity
from ballast.settings import Settings
from bench.stack import Stack, ballast_up
from bench.timeline import VLLM_ROLES, CpuSampler, draw

SEED = 7
ALPHABET = "abcdefghijklmnopqrstuvwxyz      ,.ABCDEFGHIJ0123456789"
PICTURE = Path(__file__).with_name("batch-timeline.png")


def workload(n: int, seed: int = SEED) -> list[dict]:
    """n completions: prompts of 100-500 tokens (byte tokenizer: one per character),
    128-256 output tokens each, greedy, run to max_tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(100, 500)))
        out.append(dict(model=None, prompt=prompt, max_tokens=rng.randint(128, 256), temperature=0, ignore_eos=True))
    return out


# -- arm 1: raw vLLM ---------------------------------------------------------------------


async def raw_arm(settings: Settings, batches: dict[str, list[dict]], long_s: float | None = None) -> dict:
    """Each batch through one in-process engine. With `long_s`, the "long" batch is sized
    from the short one's throughput to run that long (its requests are returned)."""
    from engine.models import resolve_model
    from engine.vllm_engine import Engine

    engine = await Engine.start(resolve_model(settings), kv_cache_gib=settings.kv_cache_gib,
                                max_num_seqs=settings.max_num_seqs, nice=settings.engine_nice)
    everywhere = os.sched_getaffinity(0)
    if settings.isolate_engine_cpus:  # as `ballast up` places its processes: the same for both arms
        affinity.keep_off_model_workers(os.getpid())
    out: dict[str, Any] = {}
    try:
        async def one(i: int, r: dict, items: list) -> int:
            n, start = 0, time.time()
            async for step in engine.generate(f"raw-{i}", engine.render_text(r["prompt"]), max_tokens=r["max_tokens"],
                                              temperature=0.0, ignore_eos=True):
                n += len(step.token_ids)
            items.append((start, time.time()))
            return n

        async def sample(load: list) -> None:
            while True:
                load.append((time.time(), engine.load.running, engine.load.waiting))
                await asyncio.sleep(0.05)

        await one(-1, dict(prompt="warm up", max_tokens=8), [])
        for name in ("short", "long"):
            reqs = batches.get(name)
            if name == "long" and reqs is None and long_s is not None:
                per_request = statistics.mean(r["max_tokens"] for r in batches["short"])
                reqs = batches["long"] = workload(math.ceil(long_s * out["short"]["tps"] / per_request), seed=SEED + 1)
            if not reqs:
                continue
            items: list = []
            load: list = []
            sampler = asyncio.create_task(sample(load))
            with CpuSampler(os.getpid(), root_role="vLLM frontend") as cpu:
                t0 = time.time()
                tokens = sum(await asyncio.gather(*(one(i, r, items) for i, r in enumerate(reqs))))
                seconds = time.time() - t0
            sampler.cancel()
            out[name] = dict(seconds=seconds, tokens=tokens, tps=tokens / seconds, requests=len(reqs),
                             cpu=cpu.totals(), timeline=dict(t0=t0, load=load, items=items, cpu=cpu.samples))
        return out
    finally:
        engine.shutdown()
        for tid in map(int, os.listdir(f"/proc/{os.getpid()}/task")):  # the next arm's stack inherits ours
            os.sched_setaffinity(tid, everywhere)


# -- arm 2: through Ballast --------------------------------------------------------------


def ballast_arm(settings: Settings, batches: dict[str, list[dict]], log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d:
        trace = Path(d) / "engine-trace.jsonl"
        with ballast_up(settings, Path(d), BALLAST_ENGINE_TRACE=str(trace)) as stack:
            warm = run_batch(stack, [dict(batches["short"][0], max_tokens=8)], settings)
            log(f"  warm-up batch: {warm['seconds']:.2f} s")
            out = {}
            for name, reqs in batches.items():
                with CpuSampler(stack.pid, root_role="ballast up") as cpu:
                    got = run_batch(stack, reqs, settings)
                got.update(cpu=cpu.totals(), timeline=dict(_trace(trace, got["t0"], got["t0"] + got["seconds"]),
                                                           t0=got["t0"], cpu=cpu.samples))
                out[name] = got
            return out


def run_batch(stack: Stack, reqs: list[dict], settings: Settings, poll_s: float = 0.5) -> dict:
    api = stack.api
    lines = "".join(
        json.dumps(dict(custom_id=f"r{i}", method="POST", url="/v1/completions",
                        body=dict(r, model=settings.model_name)))
        + "\n"
        for i, r in enumerate(reqs)
    ).encode()
    t0 = time.time()
    fid = api.post("/v1/files", files={"file": ("bench.jsonl", lines)},
                   data={"purpose": "batch"}).raise_for_status().json()["id"]
    bid = api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/completions",
                                            completion_window="24h")).json()["id"]
    while (b := api.get(f"/v1/batches/{bid}").json())["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(poll_s)
    assert b["status"] == "completed", b
    seconds = _completed_at(stack.db_url, bid) - t0
    out = _download(api, b["output_file_id"])
    assert len(out) == len(reqs), (len(out), len(reqs))
    tokens = sum(json.loads(ln)["response"]["body"]["usage"]["completion_tokens"] for ln in out)
    return dict(seconds=seconds, tokens=tokens, tps=tokens / seconds, requests=len(reqs), t0=t0)


def _download(api: httpx.Client, file_id: str) -> list[str]:
    return api.get(f"/v1/files/{file_id}/content").text.splitlines()


def _completed_at(db_url: str, batch_id: str) -> float:
    """When the journal recorded the batch completed (wall clock, as `time.time()`)."""
    import psycopg

    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT extract(epoch FROM committed_at)::float FROM events WHERE stream = %s"
                           " AND type = 'batch_status' AND payload->>'status' = 'completed'",
                           (f"batch:{batch_id}",)).fetchone()
    assert row is not None, f"batch {batch_id} has no completed status in the journal"
    return row[0]


def _trace(path: Path, start: float, end: float) -> dict:
    """The engine worker's timeline (engine/trace.py) between start and end."""
    load, activities, commits, submitted, items = [], [], [], {}, []
    lines = path.read_text().splitlines() if path.exists() else []
    for ln in lines:
        e = json.loads(ln)
        if not start <= e["t"] <= end + 0.5:
            continue
        if e["ev"] == "load":
            load.append((e["t"], e["running"], e["waiting"]))
        elif e["ev"] == "activity":
            activities.append(e["t"])
        elif e["ev"] == "commit":
            commits.append((e["at"], e["ms"]))
        elif e["ev"] == "submit":
            submitted[e["item"]] = e["t"]
        elif e["ev"] == "finish" and e["item"] in submitted:
            items.append((submitted.pop(e["item"]), e["t"]))
    return dict(load=load, activities=activities, commits=commits, items=items)


# -- the comparison ------------------------------------------------------------------------


def per_1k(cpu: dict[str, float], tokens: int) -> dict[str, float]:
    return {k: round(1000 * v / tokens, 4) for k, v in cpu.items() if v > 0}


def control_plane(cpu: dict[str, float]) -> float:
    """CPU seconds of everything that is not vLLM's engine core and model worker: in the
    raw arm vLLM's frontend (the bench process), in Ballast every other process of the
    stack (the engine worker, which holds vLLM's frontend, API, control worker, Temporal,
    Postgres)."""
    return sum(v for k, v in cpu.items() if k not in VLLM_ROLES)


def summarise(rounds: list[dict[str, dict]], size: str) -> dict:
    raw = [r["raw"][size] for r in rounds if size in r["raw"]]
    bal = [r["ballast"][size] for r in rounds if size in r["ballast"]]
    raw_tps, bal_tps = statistics.median(x["tps"] for x in raw), statistics.median(x["tps"] for x in bal)
    last_raw, last_bal = raw[-1], bal[-1]
    return dict(
        requests=raw[0]["requests"], output_tokens=raw[0]["tokens"],
        raw_tokens_per_s=round(raw_tps, 1), ballast_tokens_per_s=round(bal_tps, 1),
        ratio=round(bal_tps / raw_tps, 3),
        ratios_per_round=[round(b["tps"] / r["tps"], 3) for r, b in zip(raw, bal, strict=False)],
        raw_seconds=[round(x["seconds"], 2) for x in raw], ballast_seconds=[round(x["seconds"], 2) for x in bal],
        # Control-plane CPU per 1,000 output tokens (medians over the rounds), and the
        # last round's CPU per process per 1,000 tokens.
        raw_control_cpu_per_1k=round(statistics.median(1000 * control_plane(x["cpu"]) / x["tokens"] for x in raw), 4),
        ballast_control_cpu_per_1k=round(statistics.median(1000 * control_plane(x["cpu"]) / x["tokens"]
                                                           for x in bal), 4),
        raw_cpu_per_1k=per_1k(last_raw["cpu"], last_raw["tokens"]),
        ballast_cpu_per_1k=per_1k(last_bal["cpu"], last_bal["tokens"]),
    )


def main(settings: Settings, requests: int = 256, runs: int = 3, long_s: float = 65.0,
         picture: Path | None = PICTURE) -> int:
    batches: dict[str, list[dict]] = {"short": workload(requests)}
    print(f"bench batch: a short batch of {requests} completions and a long one sized to ≥ {long_s:.0f} s on raw "
          f"vLLM; prompts 100-500 tokens, 128-256 output tokens; {runs} rounds alternating raw and Ballast; "
          f"model {settings.model_name}", flush=True)
    rounds: list[dict[str, dict]] = []
    for n in range(1, runs + 1):
        print(f"round {n}/{runs}, raw vLLM AsyncLLM (in process) …", flush=True)
        raw = asyncio.run(raw_arm(settings, batches, long_s if long_s > 0 else None))
        for name, r in raw.items():
            print(f"  {name}: {r['tokens']} tokens in {r['seconds']:.2f} s ({r['tps']:.0f} tok/s)", flush=True)
        print(f"round {n}/{runs}, Ballast (ballast up: REST → Temporal → engine worker → journal) …", flush=True)
        bal = ballast_arm(settings, batches)
        for name, r in bal.items():
            print(f"  {name}: {r['tokens']} tokens in {r['seconds']:.2f} s ({r['tps']:.0f} tok/s, "
                  f"{r['tps'] / raw[name]['tps']:.3f} × raw)", flush=True)
        rounds.append(dict(raw=raw, ballast=bal))

    out: dict[str, Any] = dict(bench="batch", rounds=runs, run=uuid.uuid4().hex[:8])
    for size, target in (("short", 0.90), ("long", 0.95)):
        if size not in batches:
            continue
        s = out[size] = summarise(rounds, size)
        s["target"] = target
        print(f"\n{size} batch ({s['requests']} requests, {s['output_tokens']} output tokens), medians of {runs}:")
        print(f"  raw vLLM  {s['raw_tokens_per_s']:9.1f} tok/s   Ballast {s['ballast_tokens_per_s']:9.1f} tok/s   "
              f"ratio {s['ratio']:.3f} (target ≥ {target}); per round {s['ratios_per_round']}")
        print(f"  control-plane CPU per 1,000 output tokens: raw {s['raw_control_cpu_per_1k']:.3f} s, "
              f"Ballast {s['ballast_control_cpu_per_1k']:.3f} s")
        print(f"  Ballast CPU s per 1,000 tokens, by process: {s['ballast_cpu_per_1k']}")
    if picture is not None:
        last = rounds[-1]
        arms = [dict(last["raw"]["short"]["timeline"], name=f"raw vLLM: {last['raw']['short']['tps']:.0f} tok/s"),
                dict(last["ballast"]["short"]["timeline"],
                     name=f"Ballast: {last['ballast']['short']['tps']:.0f} tok/s")]
        draw(picture, arms, f"bench batch, short batch ({requests} completions), round {runs}")
        print(f"\ntimeline: {picture}")
        out["picture"] = str(picture)
    print(json.dumps(out))
    return 0
