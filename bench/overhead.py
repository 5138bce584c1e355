"""`ballast bench overhead`: what Ballast adds to an interactive request's TTFT.

Arm 1: the same streamed chat requests straight to an in-process vLLM AsyncLLM.
Arm 2: through `ballast up`: HTTP → API (validate, place, engine worker NDJSON stream,
workflow started once it has ended) → SSE. Requests go one at a time so queueing
does not blur the overhead, twice: paced (GAP_S apart, as users send them: the path's own
cost) and back to back (each request's bookkeeping — workflow start and task, journal
write — then runs during the next one's TTFT: what the control plane's CPU costs on a
machine with no cores to spare). Both arms time the first text (the client's first
non-empty content; the byte-level tiny model's first token is often part of a character
and carries none). Prints TTFT p50/p99 for both arms, the ratio and the
added milliseconds; where the time goes (the journal records the TTFT the API and the
engine worker each saw); then what one request costs the control plane: Temporal actions
and history events (read back from the server) and Postgres rows written. One JSON line
last.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.settings import Settings
from bench.stack import ballast_up
from bench.surge import pct

PROMPTS = [f"Question {i}: what is {i} plus {i * 7}?" for i in range(60)]
MAX_TOKENS = 16
GAP_S = 0.1
PACINGS = (("paced", GAP_S), ("back to back", 0.0))


async def direct(settings: Settings, gap_s: float) -> list[float]:
    from engine.models import resolve_model
    from engine.vllm_engine import Engine

    engine = await Engine.start(resolve_model(settings), kv_cache_gib=settings.kv_cache_gib,
                                max_num_seqs=settings.max_num_seqs, nice=settings.engine_nice)
    try:
        ttft = []
        for i, p in enumerate(["warm up", *PROMPTS]):
            await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            ids = engine.render_chat([dict(role="user", content=p)])
            async for step in engine.generate(f"d-{i}", ids, max_tokens=MAX_TOKENS, temperature=0.0, detokenize=True):
                if step.text:  # the first text, as the client of the other arm sees it (the byte-level
                    ttft.append(time.perf_counter() - t0)  # model's first token is often only part of a character)
                    break
            await engine.abort(f"d-{i}")
        return ttft[1:]
    finally:
        engine.shutdown()


def through_ballast(api, model: str, gap_s: float) -> tuple[list[float], list[str]]:
    ttft: list[float] = []
    ids: list[str] = []
    for p in ["warm up", *PROMPTS]:
        time.sleep(gap_s)
        body = dict(model=model, messages=[dict(role="user", content=p)], max_tokens=MAX_TOKENS, temperature=0,
                    stream=True)
        t0 = time.perf_counter()
        with api.stream("POST", "/v1/chat/completions", json=body) as r:
            first: float | None = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                ids.append(chunk["id"])
                delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                if first is None and delta.get("content"):
                    first = time.perf_counter() - t0
        assert first is not None, f"no content streamed back for {p!r}"
        ttft.append(first)
    return ttft[1:], list(dict.fromkeys(ids))[1:]


async def control_plane_cost(temporal_address: str, request_id: str) -> dict:
    from temporalio.client import Client
    from temporalio.service import RPCError

    client = await Client.connect(temporal_address)
    handle = client.get_workflow_handle(f"request:{request_id}")
    for _ in range(100):  # its start goes out once the request has ended, in the background
        try:
            await handle.result()
            break
        except RPCError:
            await asyncio.sleep(0.1)
    history = await handle.fetch_history()
    kinds = [e.WhichOneof("attributes") for e in history.events]
    local = kinds.count("marker_recorded_event_attributes")
    signals = kinds.count("workflow_execution_signaled_event_attributes")
    activities = kinds.count("activity_task_scheduled_event_attributes")
    timers = kinds.count("timer_started_event_attributes")  # billed as actions too
    return dict(history_events=len(history.events), actions=1 + signals + activities + local + timers,
                workflow_starts=1, signals=signals, activities=activities, local_activities=local, timers=timers)


def main(settings: Settings) -> int:
    print(f"bench overhead: {len(PROMPTS)} streamed chat requests, one at a time, max_tokens {MAX_TOKENS}", flush=True)
    print("arm 1: direct AsyncLLM …", flush=True)
    raw = {name: asyncio.run(direct(settings, gap)) for name, gap in PACINGS}
    print("arm 2: through Ballast (ballast up) …", flush=True)
    bal, seen = {}, {}
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, ballast_up(settings, Path(d)) as stack:
        for name, gap in PACINGS:
            bal[name], ids = through_ballast(stack.api, settings.model_name, gap)
            seen[name] = _journaled_ttfts(stack.db_url, ids)
        cost = asyncio.run(control_plane_cost(stack.temporal_address, ids[-1]))
        rows = _rows_per_request(stack.db_url, ids[-1])
    out: dict[str, Any] = dict(bench="overhead", requests=len(PROMPTS), gap_s=GAP_S)
    for name, _ in PACINGS:
        key = name.replace(" ", "_")
        d50, d99, b50, b99 = (1000 * pct(xs, q) for xs in (raw[name], bal[name]) for q in (50, 99))
        api_ms, engine_ms = seen[name]
        out[key] = dict(direct_ttft_p50_ms=round(d50, 2), direct_ttft_p99_ms=round(d99, 2),
                        ballast_ttft_p50_ms=round(b50, 2), ballast_ttft_p99_ms=round(b99, 2),
                        added_p50_ms=round(b50 - d50, 2), added_p99_ms=round(b99 - d99, 2),
                        ratio_p50=round(b50 / d50, 3),
                        # p50s of what each hop saw: the client (above), the API, the engine worker.
                        api_ttft_p50_ms=round(pct(api_ms, 50), 2), engine_ttft_p50_ms=round(pct(engine_ms, 50), 2))
    out.update(temporal=cost, postgres_rows_per_request=rows)
    for name, _ in PACINGS:
        r = out[name.replace(" ", "_")]
        print(f"\n{name}:")
        print(f"  direct     TTFT p50 {r['direct_ttft_p50_ms']:7.2f} ms  p99 {r['direct_ttft_p99_ms']:7.2f} ms")
        print(f"  Ballast    TTFT p50 {r['ballast_ttft_p50_ms']:7.2f} ms  p99 {r['ballast_ttft_p99_ms']:7.2f} ms")
        print(f"  added      p50 {r['added_p50_ms']:+.2f} ms  p99 {r['added_p99_ms']:+.2f} ms"
              f"  (ratio p50 {r['ratio_p50']}×)")
        print(f"  TTFT p50 as each hop saw it: engine worker {r['engine_ttft_p50_ms']:.2f} ms,"
              f" API {r['api_ttft_p50_ms']:.2f} ms, client {r['ballast_ttft_p50_ms']:.2f} ms")
    print(f"\nper request: {cost['actions']} Temporal actions ({cost}), {rows} Postgres rows")
    print(json.dumps(out))
    return 0


def _journaled_ttfts(db_url: str, request_ids: list[str]) -> tuple[list[float], list[float]]:
    """The TTFTs the API and the engine worker recorded, from the journal (each request's
    outcome is journaled a moment after its response, in the background)."""
    import psycopg

    streams = [f"request:{r}" for r in request_ids]
    with psycopg.connect(db_url) as conn:
        for _ in range(100):
            rows = conn.execute("SELECT (payload->>'ttft_ms')::float, (payload->>'engine_ttft_ms')::float FROM events"
                                " WHERE stream = ANY(%s) AND type = 'request_finished'", (streams,)).fetchall()
            if len(rows) == len(streams):
                break
            time.sleep(0.1)
    return [r[0] for r in rows], [r[1] for r in rows]


def _rows_per_request(db_url: str, request_id: str) -> int:
    import psycopg

    with psycopg.connect(db_url) as conn:
        # Its workflow's record, and the engine worker's (journal/served.py).
        row = conn.execute("SELECT count(*) FROM events WHERE stream IN (%s, %s)",
                           (f"request:{request_id}", f"served:{request_id}")).fetchone()
        assert row is not None  # count(*) always has its row
        return row[0]
