"""`ballast bench grouping`: a batch's prefix stickiness (policy/grouping.py) against
groups sent to the shared queue, whichever engine worker claims them, on the same pool in
one run.

Each arm is a fresh `ballast up --engines 2` with the bench placement's KV cache (8,192
tokens per engine: a third of the batch's distinct system prompts), default settings but
BALLAST_BATCH_STICKY_WAIT_S (0 turns sticky groups off). Each runs the same batch through
the Batches API, twice (`rounds`): SYSTEMS tenants' system prompts of 600-1,400
tokens, ITEMS_PER_SYSTEM questions each, in random order as users write files, MAX_TOKENS
tokens each. A page clusters items by prompt in both arms; what differs is whether the
groups of one prompt (more items than a group holds) go to one worker or to whichever
claims them.

Per arm: the prefix-cache hit rate from vLLM's own counters (hit over queried prompt
tokens, both engines, over the batches), the batches' wall time (created to the journal's
`completed`), and how many engine workers each system prompt's items ran on (from the
workflow's history: the worker that started each generation). One JSON line last.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.placement import KV_CACHE_TOKENS, SEED, SYSTEMS, _engines, _text, kv_bytes_per_token
from bench.stack import Stack, ballast_up
from bench.stats import p50
from config import Settings

ITEMS_PER_SYSTEM = 40  # 2.5 groups of the default 16
MAX_TOKENS = 4
ARMS = {"sticky": {}, "shared": {"BALLAST_BATCH_STICKY_WAIT_S": "0"}}


def workload(model: str, seed: int = SEED) -> list[dict]:
    rng = random.Random(f"{seed}:grouping")
    systems = [_text(rng, rng.randrange(600, 1400)) for _ in range(SYSTEMS)]
    items = [(s, q) for s in range(SYSTEMS) for q in range(ITEMS_PER_SYSTEM)]
    rng.shuffle(items)
    return [dict(custom_id=f"s{s}-q{q}", method="POST", url="/v1/chat/completions",
                 body=dict(model=model, max_tokens=MAX_TOKENS, temperature=0, messages=[
                     dict(role="system", content=systems[s]), dict(role="user", content=f"{q}: {_text(rng, 60)}")]))
            for s, q in items]


def run_batch(stack: Stack, lines: list[dict]) -> tuple[str, float]:
    from bench.batch import completed_at

    api = stack.api
    body = "".join(json.dumps(ln) + "\n" for ln in lines).encode()
    t0 = time.time()
    fid = api.post("/v1/files", files={"file": ("grouping.jsonl", body)},
                   data={"purpose": "batch"}).raise_for_status().json()["id"]
    bid = api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/chat/completions",
                                            completion_window="24h")).raise_for_status().json()["id"]
    while (b := api.get(f"/v1/batches/{bid}").json())["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
    assert b["status"] == "completed" and b["request_counts"]["completed"] == len(lines), b
    return bid, completed_at(stack.db_url, bid) - t0


async def workers_per_system(stack: Stack, bid: str, lines: list[dict]) -> float:
    """The mean number of engine workers a system prompt's items ran on."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    temporal = await Client.connect(stack.temporal_address)
    events = [e async for e in temporal.get_workflow_handle(f"batch:{bid}").fetch_history_events()]
    # One run: the batch is smaller than BALLAST_BATCH_ITEMS_PER_RUN (1,000), so no continue-as-new.
    assert events[0].workflow_execution_started_event_attributes.continued_execution_run_id == ""
    inputs = {e.event_id: json.loads(e.activity_task_scheduled_event_attributes.input.payloads[0].data)
              for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
              and e.activity_task_scheduled_event_attributes.activity_type.name == "generate"}
    ran_on: dict[str, set[str]] = {}
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            a = e.activity_task_started_event_attributes
            for idx in inputs.get(a.scheduled_event_id, {}).get("idxs", []):
                ran_on.setdefault(lines[idx]["custom_id"].split("-")[0], set()).add(a.identity)
    return round(statistics.mean(len(w) for w in ran_on.values()), 2)


def run_arm(settings: Settings, env: dict[str, str], lines: list[dict], kv_gib: float, rounds: int) -> dict[str, Any]:
    import asyncio

    with tempfile.TemporaryDirectory(prefix="ballast-bench-grouping-") as d, \
            ballast_up(settings, Path(d), BALLAST_ENGINES="2", BALLAST_KV_CACHE_GIB=f"{kv_gib:.6f}", **env) as stack:
        deadline = time.monotonic() + 120
        while len(_engines(stack.db_url)) < 2:  # both announced before the batch
            assert time.monotonic() < deadline, "the second engine worker never announced itself"
            time.sleep(0.5)
        before = _engines(stack.db_url)
        seconds, spread = [], []
        for _ in range(rounds):
            bid, s = run_batch(stack, lines)
            seconds.append(round(s, 2))
            spread.append(asyncio.run(workers_per_system(stack, bid, lines)))
        time.sleep(2.5)  # the engines' counters are announced every second
        after = _engines(stack.db_url)
    queried = sum(after[e]["prefix_queries"] - before[e]["prefix_queries"] for e in after)
    hits = sum(after[e]["prefix_hits"] - before[e]["prefix_hits"] for e in after)
    return dict(hit_rate=round(hits / max(1, queried), 4), queried_tokens=queried,
                missed_tokens=queried - hits, seconds=seconds, workers_per_system=spread)


def main(settings: Settings, rounds: int = 2) -> int:
    from engine.model_spec import resolve_model

    spec = resolve_model(settings)
    kv_gib = KV_CACHE_TOKENS * kv_bytes_per_token(spec.path) / 2**30
    lines = workload(spec.name)
    print(f"bench grouping: a batch of {len(lines)} chats ({SYSTEMS} system prompts × {ITEMS_PER_SYSTEM}, shuffled), "
          f"{rounds} rounds per arm; arms {', '.join(ARMS)}, each a fresh `ballast up --engines 2`", flush=True)
    out: dict[str, Any] = dict(bench="grouping", items=len(lines), rounds=rounds)
    for arm, env in ARMS.items():
        print(f"arm {arm} …", flush=True)
        out[arm] = run_arm(settings, env, lines, kv_gib, rounds)
    s, sh = out["sticky"], out["shared"]
    out["ratios"] = dict(missed_tokens=round(s["missed_tokens"] / max(1, sh["missed_tokens"]), 3),
                         seconds=round(p50(s["seconds"]) / p50(sh["seconds"]), 3))
    print(f"\n{'arm':8} {'hit rate':>8} {'missed tokens':>14} {'seconds':>16} {'workers/prompt':>15}")
    for arm in ARMS:
        a = out[arm]
        print(f"{arm:8} {a['hit_rate']:8.4f} {a['missed_tokens']:14d} {str(a['seconds']):>16} "
              f"{str(a['workers_per_system']):>15}")
    print(f"sticky / shared: missed prompt tokens {out['ratios']['missed_tokens']}×, "
          f"batch time (median) {out['ratios']['seconds']}×")
    print(json.dumps(out))
    return 0
