"""`ballast bench cost`: what the control plane spends per unit of work, and what that
comes to at the seeds' scale.

One `ballast up` stack; its idle cost first, then three workloads one after another, each
measured alone:
- requests: REQUESTS small chats (max_tokens 1..16, greedy), CONCURRENCY at a time, as
  `bench rate` drives them;
- a batch of ITEMS chat items (max_tokens 16, every token generated);
- a fine-tuning job (bench/training.py's file, EPOCHS epochs).

For each: Temporal billed actions, read back from the server's histories (every workflow
run's started, activity scheduled, local activity marker, timer, signal, search-attribute
upsert and child-start events committed while it ran), plus the activity heartbeats the
server would bill, which histories do not hold (estimated: each activity's run time over
its heartbeat throttle, 0.8 × its heartbeat timeout, the SDK's); Postgres rows written
(pg_stat_user_tables: inserted, updated, deleted, as `bench overhead` reads them); CPU
seconds per process (/proc); each less the stack's idle rate over the same seconds, per
unit and per 1,000 tokens the unit produced, and the control plane's (every process but
vLLM's own) per unit.

Then `project`: those figures at 1 million requests a minute across 30 regions (the
seeds' scale), with the assumptions printed beside them. One JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from datetime import UTC
from pathlib import Path
from typing import Any

from bench import overhead, rate, training
from bench.batch import cpu_between
from bench.stack import Stack, ballast_up
from bench.timeline import VLLM_ROLES, CpuSampler
from config import Settings

REQUESTS = 1000
CONCURRENCY = 8
ITEMS = 256
ITEM_TOKENS = 16
EPOCHS = 2
IDLE_S = 30.0

# Billed per event of these types (Temporal Cloud's "actions"; a continue-as-new is its
# new run's start).
BILLED = {
    "workflow_execution_started_event_attributes", "activity_task_scheduled_event_attributes",
    "marker_recorded_event_attributes", "timer_started_event_attributes",
    "workflow_execution_signaled_event_attributes", "upsert_workflow_search_attributes_event_attributes",
    "start_child_workflow_execution_initiated_event_attributes",
}


async def actions_between(address: str, start: float, end: float) -> dict[str, float]:
    """Billed actions committed in [start, end] (unix s), by workflow type, across every
    workflow run on the server, and the heartbeats of activities that ran then."""
    from temporalio.client import Client

    client = await Client.connect(address)
    got: dict[str, float] = {}
    async for wf in client.list_workflows():
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        n = 0.0
        scheduled: dict[int, float] = {}  # scheduled event id → heartbeat throttle (s)
        started: dict[int, float] = {}
        for e in history.events:
            at = e.event_time.ToDatetime(tzinfo=UTC).timestamp()
            kind = e.WhichOneof("attributes")
            if kind == "activity_task_scheduled_event_attributes":
                hb = e.activity_task_scheduled_event_attributes.heartbeat_timeout.ToTimedelta().total_seconds()
                if hb > 0:
                    scheduled[e.event_id] = 0.8 * hb
            elif kind == "activity_task_started_event_attributes":
                started[e.activity_task_started_event_attributes.scheduled_event_id] = at
            elif kind in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                          "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):
                sid = getattr(e, kind).scheduled_event_id
                if sid in scheduled and sid in started:  # the part of its run inside the window
                    ran = max(0.0, min(at, end) - max(started[sid], start))
                    n += ran / scheduled[sid]
            if kind in BILLED and start <= at <= end:
                n += 1
        if n:
            got[wf.workflow_type] = got.get(wf.workflow_type, 0.0) + n
    return got


def _less_idle(got: dict[str, float], idle: dict[str, float], idle_s: float, seconds: float) -> dict[str, float]:
    return {k: max(0.0, got.get(k, 0.0) - idle.get(k, 0.0) * seconds / idle_s) for k in set(got) | set(idle)}


class Meter:
    """The stack's counters around one workload: Temporal actions, Postgres rows, CPU."""

    def __init__(self, stack: Stack, sampler: CpuSampler):
        self.stack, self.sampler = stack, sampler
        self.idle: dict[str, Any] = {}

    def measure_idle(self) -> None:
        time.sleep(overhead.FLUSH_S)  # start-up's writes out of the way
        rows, t0 = overhead.table_writes(self.stack.db_url), time.time()
        time.sleep(IDLE_S)
        t1 = time.time()
        time.sleep(overhead.FLUSH_S)  # the idle window's last counters flushed
        self.idle = dict(seconds=t1 - t0, rows=overhead._delta(overhead.table_writes(self.stack.db_url), rows),
                         actions=asyncio.run(actions_between(self.stack.temporal_address, t0, t1)),
                         cpu=cpu_between(self.sampler.samples, t0, t1))

    def start(self) -> tuple[float, dict]:
        return time.time(), overhead.table_writes(self.stack.db_url)

    def end(self, began: tuple[float, dict], units: int, tokens: int) -> dict[str, Any]:
        """Per unit, once what the workload wrote has settled (call when it is journaled)."""
        t0, rows0 = began
        t1 = time.time()
        time.sleep(overhead.FLUSH_S)
        seconds, idle_s = t1 - t0, self.idle["seconds"]
        rows = overhead._delta(overhead.table_writes(self.stack.db_url), rows0)
        per_table = {t.removeprefix("public."): round(
            (sum(rows.get(t, (0, 0, 0))) - sum(self.idle["rows"].get(t, (0, 0, 0))) * seconds / idle_s) / units, 3)
            for t in set(rows) | set(self.idle["rows"])}
        per_table = {t: v for t, v in sorted(per_table.items()) if abs(v) >= 0.001}
        actions = _less_idle(asyncio.run(actions_between(self.stack.temporal_address, t0, t1)),
                             self.idle["actions"], idle_s, seconds)
        cpu = _less_idle(cpu_between(self.sampler.samples, t0, t1), self.idle["cpu"], idle_s, seconds)
        k = max(tokens, 1) / 1000
        return dict(units=units, tokens=tokens, seconds=round(seconds, 1),
                    actions_per_unit=round(sum(actions.values()) / units, 4),
                    actions_by_type={t: round(v / units, 4) for t, v in sorted(actions.items()) if v},
                    rows_per_unit=round(sum(per_table.values()), 3), rows_by_table=per_table,
                    cpu_s_per_1k_tokens={r: round(v / k, 4) for r, v in sorted(cpu.items()) if v >= 0.005},
                    # vLLM's own processes are the data plane, what any server of the model spends.
                    control_cpu_s_per_unit=round(sum(v for r, v in cpu.items() if r not in VLLM_ROLES) / units, 5))


def requests(stack: Stack, model: str, meter: Meter, n: int) -> dict[str, Any]:
    began = meter.start()
    got = asyncio.run(rate.drive(str(stack.api.base_url), dict(stack.api.headers), model, n, CONCURRENCY))
    asyncio.run(overhead.control_plane_cost(stack.temporal_address, got["ids"]))  # every window has run
    units = len(got["ids"])  # the warm-up's too: the counters saw them
    out = meter.end(began, units, round(got["completion_tokens_per_s"] / got["requests_per_s"] * units))
    out["requests_per_s"] = round(got["requests_per_s"], 1)
    return out


def batch(stack: Stack, model: str, meter: Meter, items: int) -> dict[str, Any]:
    lines = [json.dumps(dict(custom_id=f"i{i}", method="POST", url="/v1/chat/completions", body=dict(
        model=model, max_tokens=ITEM_TOKENS, temperature=0, ignore_eos=True,
        messages=[dict(role="user", content=f"Item {i}: say something.")]))) for i in range(items)]
    file_id = stack.api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines) + "\n")},
                             data={"purpose": "batch"}).raise_for_status().json()["id"]
    began = meter.start()
    b = stack.api.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                completion_window="24h")).raise_for_status().json()
    deadline = time.monotonic() + 900
    while (b := stack.api.get(f"/v1/batches/{b['id']}").json())["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.5)
    assert b["status"] == "completed" and b["request_counts"]["completed"] == items, b
    time.sleep(2.0)  # the workflow's last task, after the object says completed
    return meter.end(began, items, b["usage"]["output_tokens"])


def fine_tune(stack: Stack, model: str, meter: Meter) -> dict[str, Any]:
    file_id = stack.api.post("/v1/files", files={"file": ("train.jsonl", training.training_file())},
                             data={"purpose": "fine-tune"}).raise_for_status().json()["id"]
    training.wait_done(stack, training.create_job(stack, file_id, model, 1, training.SEED))  # loads the base model
    began = meter.start()
    job_id = training.create_job(stack, file_id, model, EPOCHS, training.SEED + 1)
    job = training.wait_done(stack, job_id)
    time.sleep(2.0)
    steps = training.journal(stack, job_id)["steps"]
    out = meter.end(began, steps, job["trained_tokens"])
    out["unit"] = "optimizer step"
    return out


# -- the projection ---------------------------------------------------------------------

SCALE = dict(
    requests_per_min=1_000_000, regions=30,
    api_processes_per_region=8,  # the API replicas that share a region's requests
    batch_items_per_request=0.25,  # batch items per interactive request, fleet-wide
    fine_tune_steps_per_s=50,  # optimizer steps per second across all regions
    usd_per_million_actions=25.0,  # Temporal Cloud's list price band; state your own
    window_s=1.0,  # BALLAST_SETTLE_WINDOW_S
)


def project(measured: dict[str, Any], scale: dict[str, Any] = SCALE) -> dict[str, Any]:
    """The measured per-unit costs at `scale`. Requests' Temporal actions do not scale with
    the rate measured here: a window costs what it costs however many it holds, so at
    scale they are 2 per window per API process (the measured actions per window, from
    requests_per_window), not the per-request figure of this machine's rate."""
    r = measured["requests"]
    per_region_s = scale["requests_per_min"] / 60 / scale["regions"]
    per_api_s = per_region_s / scale["api_processes_per_region"]
    per_window = max(1.0, per_api_s * scale["window_s"])
    actions_per_window = r["actions_per_unit"] * r["requests_per_window"]
    request_actions = actions_per_window / per_window
    items_s = per_region_s * scale["batch_items_per_request"]
    steps_s = scale["fine_tune_steps_per_s"] / scale["regions"]
    region = dict(
        requests_per_s=round(per_region_s, 1), requests_per_window=round(per_window, 1),
        actions_per_request=round(request_actions, 4),
        actions_per_s=round(per_region_s * request_actions + items_s * measured["batch"]["actions_per_unit"]
                            + steps_s * measured["fine_tune"]["actions_per_unit"], 1),
        postgres_rows_per_s=round(per_region_s * r["rows_per_unit"] + items_s * measured["batch"]["rows_per_unit"]
                                  + steps_s * measured["fine_tune"]["rows_per_unit"]),
        control_cpu_cores=round(per_region_s * r["control_cpu_s_per_unit"]
                                + items_s * measured["batch"]["control_cpu_s_per_unit"]
                                + steps_s * measured["fine_tune"]["control_cpu_s_per_unit"], 1),
    )
    per_day = region["actions_per_s"] * scale["regions"] * 86_400
    per_request_workflow = 2 * scale["requests_per_min"] / 60 * 86_400  # one workflow per request, as before
    return dict(scale=scale, per_region=region, actions_per_day=round(per_day),
                usd_per_day=round(per_day / 1e6 * scale["usd_per_million_actions"]),
                usd_per_day_one_workflow_per_request=round(per_request_workflow / 1e6
                                                           * scale["usd_per_million_actions"]))


def main(settings: Settings, n_requests: int = REQUESTS, items: int = ITEMS) -> int:
    print(f"bench cost: idle {IDLE_S:.0f} s, {n_requests} chats ({CONCURRENCY} at a time), a batch of {items} items, "
          f"a fine-tune of {EPOCHS} epochs, on one `ballast up`", flush=True)
    out: dict[str, Any] = dict(bench="cost")
    with tempfile.TemporaryDirectory(prefix="ballast-bench-cost-") as d, ballast_up(settings, Path(d)) as stack, \
            CpuSampler(stack.pid) as sampler:
        model = stack.api.get("/v1/models").json()["data"][0]["id"]
        meter = Meter(stack, sampler)
        print("idle …", flush=True)
        meter.measure_idle()
        out["idle_per_s"] = dict(actions=round(sum(meter.idle["actions"].values()) / meter.idle["seconds"], 2),
                                 rows=round(sum(map(sum, meter.idle["rows"].values())) / meter.idle["seconds"], 2))
        print("requests …", flush=True)
        out["requests"] = requests(stack, model, meter, n_requests)
        windows = asyncio.run(_windows(stack.temporal_address))
        out["requests"]["requests_per_window"] = windows
        print("batch …", flush=True)
        out["batch"] = batch(stack, model, meter, items)
        print("fine-tune …", flush=True)
        out["fine_tune"] = fine_tune(stack, model, meter)
    out["projection"] = project(out)
    report(out)
    print(json.dumps(out))
    return 0


async def _windows(address: str) -> float:
    """Requests per RequestWindow workflow, over every window the run started."""
    from temporalio.client import Client

    from protocol.temporal import RequestWindowInput

    client = await Client.connect(address)
    sizes = []
    async for wf in client.list_workflows('WorkflowType="RequestWindow"'):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        [window] = await client.data_converter.decode(started.input.payloads, [RequestWindowInput])
        sizes.append(len(window.requests))
    return round(sum(sizes) / len(sizes), 2)


def report(out: dict[str, Any]) -> None:
    print(f"\nidle: {out['idle_per_s']['actions']} Temporal actions/s, {out['idle_per_s']['rows']} Postgres rows/s")
    for name in ("requests", "batch", "fine_tune"):
        m = out[name]
        print(f"{name}: {m['units']} units, {m['tokens']} tokens, {m['seconds']} s")
        print(f"  Temporal actions per unit {m['actions_per_unit']} {m['actions_by_type']}")
        print(f"  Postgres rows per unit {m['rows_per_unit']} {m['rows_by_table']}")
        print(f"  CPU s per 1,000 tokens {m['cpu_s_per_1k_tokens']}; control plane per unit "
              f"{m['control_cpu_s_per_unit']} s")
    p = out["projection"]
    print(f"\nat {p['scale']}:\n  per region {p['per_region']}\n  {p['actions_per_day']:,} Temporal actions a day "
          f"(${p['usd_per_day']:,}; one workflow per request would be ${p['usd_per_day_one_workflow_per_request']:,})")


