"""`ballast bench overhead`: what Ballast adds to an interactive request's TTFT.

Arm 1: the same streamed chat requests straight to an in-process vLLM AsyncLLM.
Arm 2: through `ballast up`: HTTP → API (validate, place, engine worker NDJSON stream,
eager workflow start off the token path) → SSE. Requests go one at a time so queueing
does not blur the overhead. Prints TTFT p50/p99 for both, the ratio and the added
milliseconds, then what one request costs the control plane: Temporal actions and history
events (read back from the server) and Postgres rows written. One JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from ballast.settings import Settings
from bench.stack import ballast_up
from bench.surge import pct

PROMPTS = [f"Question {i}: what is {i} plus {i * 7}?" for i in range(60)]
MAX_TOKENS = 16


async def direct(settings: Settings) -> list[float]:
    from engine.models import resolve_model
    from engine.vllm_engine import Engine

    engine = await Engine.start(resolve_model(settings), kv_cache_gib=settings.kv_cache_gib, max_num_seqs=settings.max_num_seqs)
    try:
        ttft = []
        for i, p in enumerate(["warm up", *PROMPTS]):
            t0 = time.perf_counter()
            ids = engine.render_chat([dict(role="user", content=p)])
            async for step in engine.generate(f"d-{i}", ids, max_tokens=MAX_TOKENS, temperature=0.0, detokenize=True):
                if step.token_ids:
                    ttft.append(time.perf_counter() - t0)
                    break
            await engine.abort(f"d-{i}")
        return ttft[1:]
    finally:
        engine.shutdown()


def through_ballast(api, model: str) -> tuple[list[float], list[str]]:
    ttft, ids = [], []
    for p in ["warm up", *PROMPTS]:
        body = dict(model=model, messages=[dict(role="user", content=p)], max_tokens=MAX_TOKENS, temperature=0, stream=True)
        t0 = time.perf_counter()
        with api.stream("POST", "/v1/chat/completions", json=body) as r:
            first = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                ids.append(chunk["id"])
                delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                if first is None and delta.get("content"):
                    first = time.perf_counter() - t0
        ttft.append(first)
    return ttft[1:], list(dict.fromkeys(ids))[1:]


async def control_plane_cost(temporal_address: str, request_id: str) -> dict:
    from temporalio.client import Client

    from temporalio.service import RPCError

    client = await Client.connect(temporal_address)
    handle = client.get_workflow_handle(f"request:{request_id}")
    for _ in range(100):  # its start goes out after the first token, in the background
        try:
            await handle.result()
            break
        except RPCError:
            await asyncio.sleep(0.1)
    history = await handle.fetch_history()
    kinds = [e.WhichOneof("attributes") for e in history.events]
    local = sum(1 for e in history.events if e.WhichOneof("attributes") == "marker_recorded_event_attributes")
    signals = kinds.count("workflow_execution_signaled_event_attributes")
    activities = kinds.count("activity_task_scheduled_event_attributes")
    return dict(history_events=len(history.events), actions=1 + signals + activities + local,
                workflow_starts=1, signals=signals, activities=activities, local_activities=local)


def main(settings: Settings) -> int:
    print(f"bench overhead: {len(PROMPTS)} streamed chat requests, one at a time, max_tokens {MAX_TOKENS}", flush=True)
    print("arm 1: direct AsyncLLM …", flush=True)
    raw = asyncio.run(direct(settings))
    print("arm 2: through Ballast (ballast up) …", flush=True)
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, ballast_up(settings, Path(d)) as stack:
        bal, ids = through_ballast(stack.api, settings.model_name)
        cost = asyncio.run(control_plane_cost(stack.temporal_address, ids[-1]))
        rows = _rows_per_request(Path(d), ids[-1])
    out = dict(bench="overhead", requests=len(PROMPTS),
               direct_ttft_p50_ms=round(1000 * pct(raw, 50), 2), direct_ttft_p99_ms=round(1000 * pct(raw, 99), 2),
               ballast_ttft_p50_ms=round(1000 * pct(bal, 50), 2), ballast_ttft_p99_ms=round(1000 * pct(bal, 99), 2))
    out.update(added_p50_ms=round(out["ballast_ttft_p50_ms"] - out["direct_ttft_p50_ms"], 2),
               added_p99_ms=round(out["ballast_ttft_p99_ms"] - out["direct_ttft_p99_ms"], 2),
               ratio_p50=round(pct(bal, 50) / pct(raw, 50), 3), temporal=cost, postgres_rows_per_request=rows)
    print(f"\ndirect     TTFT p50 {out['direct_ttft_p50_ms']:7.2f} ms  p99 {out['direct_ttft_p99_ms']:7.2f} ms")
    print(f"Ballast    TTFT p50 {out['ballast_ttft_p50_ms']:7.2f} ms  p99 {out['ballast_ttft_p99_ms']:7.2f} ms")
    print(f"added      p50 {out['added_p50_ms']:+.2f} ms  p99 {out['added_p99_ms']:+.2f} ms  (ratio p50 {out['ratio_p50']}×)")
    print(f"per request: {cost['actions']} Temporal actions ({cost}), {rows} Postgres rows")
    print(json.dumps(out))
    return 0


def _rows_per_request(data_dir: Path, request_id: str) -> int:
    import psycopg

    port = (data_dir / "pg.port").read_text().strip()
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres") as conn:
        return conn.execute("SELECT count(*) FROM events WHERE stream = %s", (f"request:{request_id}",)).fetchone()[0]
