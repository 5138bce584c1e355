"""`ballast bench batch`: the same batch through raw vLLM and through Ballast, one run.

Arm 1 (baseline): every request submitted at once to an in-process vLLM AsyncLLM.
Arm 2 (Ballast): the same requests as a JSONL file through `ballast up` end to end —
REST upload → batch workflow → engine worker → journal checkpoints → output file
downloaded. Same model, engine settings and requests; the engine is warm in both arms
(start-up is not counted). Prints tokens/s for each and their ratio, then one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from ballast.settings import Settings
from bench.stack import ballast_up

SEED = 7
ALPHABET = "abcdefghijklmnopqrstuvwxyz      ,.ABCDEFGHIJ0123456789"


def workload(n: int, seed: int = SEED) -> list[dict]:
    """n completions: prompts of 100-500 tokens (byte tokenizer: one per character),
    128-256 output tokens each, greedy, run to max_tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(100, 500)))
        out.append(dict(model=None, prompt=prompt, max_tokens=rng.randint(128, 256), temperature=0, ignore_eos=True))
    return out


async def raw_vllm(settings: Settings, reqs: list[dict]) -> dict:
    from engine.models import resolve_model
    from engine.vllm_engine import Engine

    engine = await Engine.start(resolve_model(settings), kv_cache_gib=settings.kv_cache_gib,
                                max_num_seqs=settings.max_num_seqs, nice=settings.engine_nice)
    try:
        async def one(i: int, r: dict) -> int:
            n = 0
            async for step in engine.generate(f"raw-{i}", engine.render_text(r["prompt"]), max_tokens=r["max_tokens"],
                                              temperature=0.0, ignore_eos=True):
                n += len(step.token_ids)
            return n

        await one(-1, dict(prompt="warm up", max_tokens=8))
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))
        return dict(seconds=time.perf_counter() - t0, tokens=tokens)
    finally:
        engine.shutdown()


def through_ballast(settings: Settings, reqs: list[dict], data_dir: Path, log=print) -> dict:
    with ballast_up(settings, data_dir) as stack:
        warm = _run_batch(stack.api, [dict(reqs[0], max_tokens=8)], settings)  # the engine's first request is slow
        log(f"  warm-up batch: {warm['seconds']:.2f} s")
        return _run_batch(stack.api, reqs, settings)


def _run_batch(api: httpx.Client, reqs: list[dict], settings: Settings) -> dict:
    lines = "".join(
        json.dumps(dict(custom_id=f"r{i}", method="POST", url="/v1/completions",
                        body=dict(r, model=settings.model_name)))
        + "\n"
        for i, r in enumerate(reqs)
    ).encode()
    t0 = time.perf_counter()
    fid = api.post("/v1/files", files={"file": ("bench.jsonl", lines)},
                   data={"purpose": "batch"}).raise_for_status().json()["id"]
    bid = api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/completions",
                                            completion_window="24h")).json()["id"]
    while (b := api.get(f"/v1/batches/{bid}").json())["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.1)
    out = api.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()
    seconds = time.perf_counter() - t0
    assert b["status"] == "completed" and len(out) == len(reqs), b
    tokens = sum(json.loads(ln)["response"]["body"]["usage"]["completion_tokens"] for ln in out)
    return dict(seconds=seconds, tokens=tokens)


def main(settings: Settings, requests: int = 256) -> int:
    reqs = workload(requests)
    out_tokens = sum(r["max_tokens"] for r in reqs)
    print(f"bench batch: {requests} completions, prompts 100-500 tokens, {out_tokens} output tokens, "
          f"model {settings.model_name}")
    print("arm 1: raw vLLM AsyncLLM (in process) …", flush=True)
    raw = asyncio.run(raw_vllm(settings, reqs))
    print(f"  {raw['tokens']} tokens in {raw['seconds']:.2f} s", flush=True)
    print("arm 2: Ballast end to end (ballast up, REST → Temporal → engine → journal → output file) …", flush=True)
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d:
        bal = through_ballast(settings, reqs, Path(d))
    print(f"  {bal['tokens']} tokens in {bal['seconds']:.2f} s")
    raw_tps, bal_tps = raw["tokens"] / raw["seconds"], bal["tokens"] / bal["seconds"]
    ratio = bal_tps / raw_tps
    print(f"\nraw vLLM   {raw_tps:9.1f} tokens/s")
    print(f"Ballast    {bal_tps:9.1f} tokens/s")
    print(f"ratio      {ratio:9.3f} × raw vLLM (target ≥ 0.90)")
    print(json.dumps(dict(bench="batch", requests=requests, output_tokens=out_tokens,
                          raw_tokens_per_s=round(raw_tps, 1), ballast_tokens_per_s=round(bal_tps, 1),
                          ratio=round(ratio, 3), raw_seconds=round(raw["seconds"], 3),
                          ballast_seconds=round(bal["seconds"], 3), run=uuid.uuid4().hex[:8])))
    return 0
