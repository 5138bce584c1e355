"""`ballast bench overhead`: what Ballast adds to an interactive request's TTFT.

Arm 1: the same streamed chat requests straight to an in-process vLLM AsyncLLM.
Arm 2: through `ballast up`: HTTP → API (validate, place, engine worker NDJSON stream,
its window's workflow started once it has ended) → SSE. Requests go one at a time so queueing
does not blur the overhead, twice: paced (GAP_S apart, as users send them: the path's own
cost) and back to back (each request's bookkeeping — its window's workflow start and
task, journal write — then runs during the next one's TTFT: what the control plane's CPU costs on a
machine with no cores to spare). Both arms time the first text (the client's first
non-empty content; the byte-level tiny model's first token is often part of a character
and carries none). REQUESTS per pacing and arm, so that p99 is not the slowest request.

Prints TTFT p50/p99 for both arms, their ratios and the added milliseconds, each with a
bootstrap 95 % interval (bench/stats.py) that resamples runs of BLOCK consecutive
requests: on a shared machine slow phases last seconds, and requests within one are not
independent draws. Then where the time goes (the journal records the TTFT the API and the
engine worker each saw); then what one request costs the control plane: Temporal actions
and history events (read back from the server), and the rows it writes in Postgres, per
table, as Postgres itself counts them (pg_stat_user_tables over the whole run, less the
stack's background writes measured idle beforehand), beside a count by hand in SQL of the
journal's and the ledger's rows for those very requests. One JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stack import Stack, ballast_up
from bench.stats import diff_ci, p50, p99, pct, ratio_ci
from config import Settings
from engine.sampling import Sampling

REQUESTS = 500  # per pacing and arm: p99 is then the 5th-slowest
MAX_TOKENS = 16
GAP_S = 0.1
PACINGS = (("paced", GAP_S), ("back to back", 0.0))
BLOCK = 25  # consecutive requests resampled together for the intervals
IDLE_S = 20.0  # the stack's background writes (announces, ticks) are measured over this, idle
# An idle backend hands its table counters to pg_stat within PGSTAT_IDLE_INTERVAL (10 s); a
# busy one at most once a second (PGSTAT_MIN_INTERVAL). Waiting this long after the last
# write leaves nothing pending.
FLUSH_S = 11.0


def prompts(n: int) -> list[str]:
    return [f"Question {i}: what is {i} plus {i * 7}?" for i in range(n)]


async def direct(settings: Settings, gap_s: float, n: int) -> list[float]:
    from engine.model_spec import resolve_model
    from engine.vllm_engine import Engine, engine_args

    spec = resolve_model(settings)  # vLLM as the engine worker configures it: like with like
    engine = await Engine.from_args(spec, engine_args(spec, settings), nice=settings.engine_nice)
    try:
        ttft = []
        for i, p in enumerate(["warm up", *prompts(n)]):
            await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            ids = engine.render_chat([dict(role="user", content=p)])
            async for step in engine.generate(f"d-{i}", ids, Sampling(MAX_TOKENS, temperature=0.0), detokenize=True):
                if step.text:  # the first text, as the client of the other arm sees it (the byte-level
                    ttft.append(time.perf_counter() - t0)  # model's first token is often only part of a character)
                    break
            await engine.abort(f"d-{i}")
        if len(ttft) != n + 1:
            raise RuntimeError(f"{n + 1 - len(ttft)} of {n + 1} direct requests produced no text")
        return ttft[1:]
    finally:
        engine.shutdown()


def through_ballast(api, model: str, gap_s: float, n: int) -> tuple[list[float], list[str]]:
    """TTFTs of the n requests after a warm-up, and the ids of all n + 1 (the warm-up's
    first): every one of them writes the journal."""
    ttft: list[float] = []
    ids: list[str] = []
    for p in ["warm up", *prompts(n)]:
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
    ids = list(dict.fromkeys(ids))
    assert len(ids) == n + 1, f"{len(ids)} distinct response ids for {n + 1} requests"
    return ttft[1:], ids


async def control_plane_cost(temporal_address: str, request_ids: list[str], timeout_s: float = 60) -> dict:
    """What journaling these requests cost Temporal, read back from the server: the windows
    whose inputs hold them (api/services/settlement.py), each once complete, and their
    billed actions (starts, signals, activities, local activities, timers) and history
    events, in all and per request they held."""
    from temporalio.client import Client, WorkflowExecutionStatus

    from protocol.temporal import RequestWindowInput

    client = await Client.connect(temporal_address)
    want, deadline = set(request_ids), time.monotonic() + timeout_s
    while True:  # a window starts after its requests ended, and runs a moment later
        windows, held = [], set()
        async for wf in client.list_workflows('WorkflowType="RequestWindow"'):
            if wf.status != WorkflowExecutionStatus.COMPLETED:
                continue
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            started = history.events[0].workflow_execution_started_event_attributes
            [window] = await client.data_converter.decode(started.input.payloads, [RequestWindowInput])
            ids = {r.request_id for r in window.requests}
            if ids & want:
                windows.append([str(e.WhichOneof("attributes")) for e in history.events])
                held |= ids
        if want <= held:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(want - held)} of {len(want)} requests in no completed window after "
                               f"{timeout_s:.0f} s: their journaling would be counted part-way")
        await asyncio.sleep(0.5)
    count = {name: sum(kinds.count(attr) for kinds in windows) for name, attr in (
        ("signals", "workflow_execution_signaled_event_attributes"),
        ("activities", "activity_task_scheduled_event_attributes"),
        ("local_activities", "marker_recorded_event_attributes"),
        ("timers", "timer_started_event_attributes"))}  # timers are billed as actions too
    actions = len(windows) + sum(count.values())
    n = len(held)
    return dict(requests=n, windows=len(windows), requests_per_window=round(n / len(windows), 2),
                actions=actions, actions_per_request=round(actions / n, 4),
                history_events_per_request=round(sum(map(len, windows)) / n, 3), workflow_starts=len(windows), **count)


def blocks(n: int) -> list[int]:
    """Each of n consecutive requests' block, for the intervals."""
    return [i // BLOCK for i in range(n)]


def compare(raw: list[float], bal: list[float]) -> dict[str, Any]:
    """Both arms' TTFT p50/p99 (ms), Ballast's over direct's with intervals, and the
    milliseconds added."""
    groups = (blocks(len(bal)), blocks(len(raw)))
    d50, d99, b50, b99 = (1000 * f(xs) for xs in (raw, bal) for f in (p50, p99))
    return dict(direct_ttft_p50_ms=round(d50, 2), direct_ttft_p99_ms=round(d99, 2),
                ballast_ttft_p50_ms=round(b50, 2), ballast_ttft_p99_ms=round(b99, 2),
                ratio_p50=ratio_ci(bal, raw, p50, groups=groups).as_dict(),
                ratio_p99=ratio_ci(bal, raw, p99, groups=groups).as_dict(),
                added_p50_ms=diff_ci(bal, raw, p50, groups=groups).as_dict(scale=1000),
                added_p99_ms=diff_ci(bal, raw, p99, groups=groups).as_dict(scale=1000))


def main(settings: Settings, requests: int = REQUESTS) -> int:
    print(f"bench overhead: {requests} streamed chat requests per pacing and arm, one at a time, "
          f"max_tokens {MAX_TOKENS}", flush=True)
    print("arm 1: direct AsyncLLM …", flush=True)
    raw = {name: asyncio.run(direct(settings, gap, requests)) for name, gap in PACINGS}
    print("arm 2: through Ballast (ballast up) …", flush=True)
    bal, seen, sent = {}, {}, []
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d, ballast_up(settings, Path(d)) as stack:
        background = idle_writes(stack.db_url)
        before = table_writes(stack.db_url)
        t0 = time.monotonic()
        for name, gap in PACINGS:
            bal[name], ids = through_ballast(stack.api, settings.model_name, gap, requests)
            sent += ids
            seen[name] = _journaled_ttfts(stack.db_url, ids[1:])
        cost = asyncio.run(control_plane_cost(stack.temporal_address, sent))
        rows = rows_per_request(stack, sent, before, background, t0)
    out: dict[str, Any] = dict(bench="overhead", requests=requests, gap_s=GAP_S, block=BLOCK)
    for name, _ in PACINGS:
        api_ms, engine_ms = seen[name]
        # p50s of what each hop saw: the client (in `compare`), the API, the engine worker.
        out[name.replace(" ", "_")] = dict(compare(raw[name], bal[name]), api_ttft_p50_ms=round(pct(api_ms, 50), 2),
                                           engine_ttft_p50_ms=round(pct(engine_ms, 50), 2))
    out.update(temporal=cost, postgres_rows_per_request=rows["total"], postgres=rows)
    report(out)
    print(json.dumps(out))
    return 0


def report(out: dict[str, Any]) -> None:
    def ci(d: dict) -> str:
        v = d.get("ratio", d.get("diff"))
        return f"{v} [{d['ci95'][0]}, {d['ci95'][1]}]"

    for name, _ in PACINGS:
        r = out[name.replace(" ", "_")]
        print(f"\n{name} (n = {out['requests']} each; 95 % intervals in brackets):")
        print(f"  direct     TTFT p50 {r['direct_ttft_p50_ms']:7.2f} ms  p99 {r['direct_ttft_p99_ms']:7.2f} ms")
        print(f"  Ballast    TTFT p50 {r['ballast_ttft_p50_ms']:7.2f} ms  p99 {r['ballast_ttft_p99_ms']:7.2f} ms")
        print(f"  added      p50 {ci(r['added_p50_ms'])} ms  p99 {ci(r['added_p99_ms'])} ms")
        print(f"  ratio      p50 {ci(r['ratio_p50'])}×  p99 {ci(r['ratio_p99'])}×")
        print(f"  TTFT p50 as each hop saw it: engine worker {r['engine_ttft_p50_ms']:.2f} ms,"
              f" API {r['api_ttft_p50_ms']:.2f} ms, client {r['ballast_ttft_p50_ms']:.2f} ms")
    pg = out["postgres"]
    print(f"\nper request: {out['temporal']['actions_per_request']} Temporal actions ({out['temporal']}); "
          f"{pg['total']} Postgres rows written (inserted + updated + deleted, pg_stat over {pg['requests']} requests)")
    for table, w in pg["tables"].items():
        print(f"  {table:32} {w}")
    print(f"  by hand in SQL for these requests: {pg['by_sql']}")


# -- Postgres rows per request ---------------------------------------------------------------------


def table_writes(db_url: str) -> dict[str, tuple[int, int, int]]:
    """(inserted, updated, deleted) rows per table, as Postgres has counted them so far."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")  # this session's own, if any
        conn.execute("SELECT pg_stat_clear_snapshot()")  # a fresh read, not a cached one
        rows = conn.execute("SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_del"
                            " FROM pg_stat_user_tables").fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def _delta(after: dict, before: dict) -> dict[str, tuple[int, int, int]]:
    out = {}
    for t, now in after.items():
        was = before.get(t, (0, 0, 0))
        d = tuple(a - b for a, b in zip(now, was, strict=True))
        if any(d):
            out[t] = d
    return out


def idle_writes(db_url: str) -> tuple[dict[str, tuple[int, int, int]], float]:
    """What the stack writes with no request in flight (engine announces, the fleet's and
    the reconciler's ticks): rows per table over IDLE_S, and the seconds they cover."""
    time.sleep(FLUSH_S)  # start-up's writes counted before the idle window opens
    a, t0 = table_writes(db_url), time.monotonic()
    time.sleep(IDLE_S)
    return _delta(table_writes(db_url), a), time.monotonic() - t0


def rows_per_request(stack: Stack, ids: list[str], before: dict, background: tuple[dict, float],
                     t0: float, timeout_s: float = 60) -> dict[str, Any]:
    """Rows each request wrote, per table: Postgres's own counters over the run, once every
    request is journaled and every counter flushed, less the idle rate over the run's
    length, over the requests. Raises if Postgres's count of the journal's or the
    ledger's inserts falls short of the rows there are for these requests."""
    _journaled_ttfts(stack.db_url, ids)  # every outcome journaled (and settled) first
    time.sleep(FLUSH_S)  # the reconciler's fold of the last settles, and every backend's counters
    by_hand = _rows_by_sql(stack.db_url, ids)
    deadline = time.monotonic() + timeout_s
    while True:
        run = _delta(table_writes(stack.db_url), before)
        seconds = time.monotonic() - t0
        short = {t: (run.get(t, (0, 0, 0))[0], n) for t, n in by_hand["inserted"].items()
                 if run.get(t, (0, 0, 0))[0] < n}
        if not short:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"pg_stat counts fewer inserts than these requests' rows (counted, in SQL): {short}")
        time.sleep(1.0)
    idle, idle_s = background
    n = len(ids)
    tables: dict[str, dict[str, float]] = {}
    for t in sorted(set(run) | set(idle)):
        got, bg = run.get(t, (0, 0, 0)), idle.get(t, (0, 0, 0))
        per = [(g - b * seconds / idle_s) / n for g, b in zip(got, bg, strict=True)]
        # Where a table is written only in the background, what is left is noise around 0 (+ 0.0: not -0.0).
        ins, upd, dele = (round(x, 3) + 0.0 for x in per)
        tables[t.removeprefix("public.")] = {"ins": ins, "upd": upd, "del": dele,
                                             "background_per_s": round(sum(bg) / idle_s, 2)}
    total = sum(w["ins"] + w["upd"] + w["del"] for w in tables.values())
    return dict(requests=n, seconds=round(seconds, 1), total=round(total, 2), tables=tables,
                by_sql={t: round(c / n, 3) for t, c in by_hand["per_kind"].items()})


def _rows_by_sql(db_url: str, ids: list[str]) -> dict[str, dict[str, int]]:
    """The journal's and the ledger's rows for these requests, counted in SQL: the events
    that list them (a window's outcomes, an engine worker's records of what it served:
    journal/served.py; each event may list other requests too), the ledger rows on their
    subjects (reserve, settle, refund: journal/ledger.py). Raises unless each request is
    listed once as finished, once as served, and settled once."""
    import psycopg

    with psycopg.connect(db_url) as conn:
        events, listed = {}, {}
        for view, kind in (("finished_requests", "request_finished"), ("served_requests", "request_served")):
            row = conn.execute(f"SELECT count(*), count(DISTINCT position) FROM {view} WHERE request_id = ANY(%s)",
                               (ids,)).fetchone()
            assert row is not None
            listed[kind], events[f"events.{kind}"] = row
        ledger = conn.execute("SELECT kind, count(*) FROM ledger WHERE subject = ANY(%s) GROUP BY kind",
                              ([f"request:{r}" for r in ids],)).fetchall()
    per_kind = events | {f"ledger.{k}": c for k, c in ledger}
    for kind, n in (*listed.items(), ("ledger.settle", per_kind.get("ledger.settle", 0))):
        if n != len(ids):  # each request exactly once
            raise RuntimeError(f"{n} {kind} for {len(ids)} requests: {per_kind}")
    return dict(inserted={"public.events": sum(events.values()), "public.ledger": sum(c for _, c in ledger)},
                per_kind=per_kind)


def _journaled_ttfts(db_url: str, request_ids: list[str], timeout_s: float = 120) -> tuple[list[float], list[float]]:
    """The TTFTs the API and the engine worker recorded, from the journal (each request's
    outcome is journaled a moment after its response, in the background). Every
    request's, or an error naming those missing."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    with psycopg.connect(db_url, autocommit=True) as conn:
        while True:
            rows = conn.execute("SELECT request_id, (record->>'ttft_ms')::float, (record->>'engine_ttft_ms')::float"
                                " FROM finished_requests WHERE request_id = ANY(%s)", (request_ids,)).fetchall()
            if len(rows) == len(request_ids):
                return [r[1] for r in rows], [r[2] for r in rows]
            if time.monotonic() > deadline:
                missing = sorted(set(request_ids) - {r[0] for r in rows})
                raise RuntimeError(f"{len(missing)} of {len(request_ids)} requests have no request_finished after "
                                   f"{timeout_s:.0f} s (e.g. {missing[:5]})")
            time.sleep(0.2)
