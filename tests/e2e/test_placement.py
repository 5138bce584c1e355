"""Placement over a pool: `ballast up --engines 2`, two engine workers with a vLLM engine
each, one in region eu and one in us. Where each request ran is the engine worker's own
record of it (`request_served`); prefix-cache hits are vLLM's own counters.

- Chats that share a long system prompt, one after another, all land on one engine, and
  vLLM reports the prompt as cached; chats of another prompt land where theirs goes; a
  burst of one prompt fills its engine to the load bound, then spills to the other.
- A batch's items that share a system prompt run on one engine worker per prompt,
  the prompts spread over both.
- A tenant fenced to a region runs only there; fenced where nothing serves, it gets a 503
  with Retry-After, never an engine outside its fence.
- An engine worker SIGKILLed mid-batch: every item completes once, token for token vLLM's
  greedy output, on the pool.
- A batch of a tenant fenced to both regions, whose first region hangs, completes in the
  other, never outside the fence.
- A drained engine takes no new work: its prefix moves to the other.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from ballast import procs
from ballast.cpus import descendants
from tests.e2e.test_batch import chat_line, greedy
from tests.e2e.test_supervise import child, completed, sql, started, submit

pytestmark = pytest.mark.e2e

SYSTEM = {name: f"You are {name}, the ship's {role}. Answer in one word, always, whatever is asked. " * 6
          for name, role in (("Ada", "navigator"), ("Brin", "cook"), ("Cole", "lookout"), ("Dora", "bosun"))}


class Pool:
    def __init__(self, up: procs.Child, api: httpx.Client, data: Path):
        self.up, self.api, self.data = up, api, data

    def cli(self, *args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BALLAST_DATABASE_URL")}
        done = subprocess.run([sys.executable, "-m", "ballast.cli", *args], capture_output=True, text=True,
                              env=dict(env, BALLAST_DATA_DIR=str(self.data)), timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def served_on(self, ids: list[str]) -> list[str]:
        """The engine each request ran on, as its engine worker recorded it."""
        q = "SELECT request_id, engine_id FROM served_requests"
        procs.wait_until(lambda: set(ids) <= {r for r, _ in sql(self.data, q)}, 60, "every request served recorded",
                         child=self.up)
        where = dict(sql(self.data, q))
        return [where[i] for i in ids]

    def engines(self) -> dict[str, dict]:
        """The live ones: announced within the last 5 s."""
        rows = sql(self.data, "SELECT id, stats, draining FROM engines WHERE seen_at > now() - interval '5 s'")
        return {id_: dict(stats, draining=d) for id_, stats, d in rows}

    def region_of(self, engine_id: str) -> str:
        return self.engines()[engine_id]["region"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model):
    data = Path(tempfile.mkdtemp(prefix="ballast-test-pool-"))  # short: Postgres's socket path
    up, api, _ = started(tmp_path_factory.mktemp("pool"), data, tiny_model, BALLAST_ENGINES="2",
                         BALLAST_ENGINE_REGIONS="eu,us", BALLAST_BATCH_SPILL_AFTER_S="5",
                         BALLAST_BATCH_STICKY_WAIT_S="3")
    try:
        p = Pool(up, api, data)
        procs.wait_until(lambda: len(p.engines()) == 2, 120, "both engine workers announced", child=up)
        yield p
    finally:
        up.stop(60)
        shutil.rmtree(data, ignore_errors=True)


def chat(api: httpx.Client, system: str, question: str, max_tokens: int = 8) -> str:
    r = api.post("/v1/chat/completions", json=dict(model="ballast-tiny", max_tokens=max_tokens, messages=[
        dict(role="system", content=system), dict(role="user", content=question)]))
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_a_prefix_sticks_to_its_engine_and_vllm_finds_it_cached(pool, tiny_model):
    ids = {name: [chat(pool.api, SYSTEM[name], f"question {i}?") for i in range(5)] for name in ("Ada", "Brin")}
    where = {name: pool.served_on(got) for name, got in ids.items()}
    assert all(len(set(engines)) == 1 for engines in where.values()), where

    # vLLM's own counters: every chat after the first found its system prompt cached.
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    block = pool.engines()[where["Ada"][0]]["block_size"]
    shared = (len(tok.encode(SYSTEM["Ada"], add_special_tokens=False)) // block - 1) * block
    time.sleep(2)  # the engines' figures are announced every second
    hits = sum(s["prefix_hits"] for s in pool.engines().values())
    assert hits >= 2 * 4 * shared > 0, (hits, shared)


def test_a_burst_of_one_prefix_spills_to_the_other_engine_at_the_bound(pool):
    burst: list[str] = []
    opened = threading.Barrier(8)

    def stream(i: int) -> None:
        body = dict(model="ballast-tiny", max_tokens=400, stream=True, messages=[
            dict(role="system", content=SYSTEM["Cole"]), dict(role="user", content=f"burst {i}")])
        with pool.api.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            burst.append(json.loads(first[6:])["id"])
            opened.wait(60)
            for _ in lines:
                pass

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    # vLLM paused on both engines while the burst is placed: none of it ends before the
    # last arrives, however slow the machine is to send them (placement is the API's,
    # before any engine step; the engine workers still count what they were sent).
    with vllm_paused(pool):
        for t in threads:
            t.start()
            time.sleep(0.05)
        procs.wait_until(lambda: sum(sum(s.get("interactive_by", {}).values()) for s in pool.engines().values())
                         == 8, 60, "the burst at the engine workers", child=pool.up)
    for t in threads:
        t.join(180)
    spread = pool.served_on(burst)
    counts = sorted(spread.count(e) for e in set(spread))
    assert len(counts) == 2 and counts[-1] <= 5, spread  # 1.25 × the mean of 8 over 2, rounded up


async def test_a_batchs_items_that_share_a_prefix_run_on_one_worker_each_prefix(pool):
    """Four system prompts, six items each, over two engine workers: each prompt's items
    all run on one worker, the one whose own queue the page sent them to (as the worker
    that started each group says: its Temporal identity, pid@host, names the engine id,
    host-pid); neither worker takes more than ceil(1.25 × 12) = 15, so both work."""
    names = sorted(SYSTEM)
    lines = [dict(custom_id=f"{name}-{i}", method="POST", url="/v1/chat/completions",
                  body=dict(model="ballast-tiny", max_tokens=8, temperature=0, messages=[
                      dict(role="system", content=SYSTEM[name]), dict(role="user", content=f"question {i}?")]))
             for i in range(6) for name in names]  # interleaved: the page clusters them
    bid = submit(pool.api, lines)
    done = completed(pool.api, bid, 300)
    out = [json.loads(x) for x in pool.api.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)

    groups = await generations(pool, bid)
    assert all(queue.endswith("/" + engine_of(identity)) for _, queue, identity in groups), groups
    ran_on = {lines[idx]["custom_id"]: queue for idxs, queue, _ in groups for idx in idxs}
    by_prompt = {name: {q for cid, q in ran_on.items() if cid.startswith(name + "-")} for name in names}
    assert all(len(qs) == 1 for qs in by_prompt.values()), by_prompt
    load = [sum(1 for q in ran_on.values() if q == w) for w in {q for qs in by_prompt.values() for q in qs}]
    assert sorted(load) == [12, 12], load


async def generations(pool: Pool, bid: str) -> list[tuple[list[int], str, str]]:
    """The batch's completed generate activities: (items, task queue, the worker that ran it)."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    with open(f"/proc/{child(pool.up, 'api')}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    temporal = await Client.connect(env[b"BALLAST_TEMPORAL_ADDRESS"].decode())
    events = [e async for e in temporal.get_workflow_handle(f"batch:{bid}").fetch_history_events()]
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes for e in events
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "generate"}
    started_by = {e.activity_task_started_event_attributes.scheduled_event_id:
                  e.activity_task_started_event_attributes.identity for e in events
                  if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED}
    done = [e.activity_task_completed_event_attributes.scheduled_event_id for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED]
    return [(json.loads(scheduled[s].input.payloads[0].data)["idxs"], scheduled[s].task_queue.name, started_by[s])
            for s in done if s in scheduled]


def engine_of(identity: str) -> str:
    """A Temporal worker identity (pid@host) as the engine id of that process (host-pid)."""
    pid, host = identity.split("@", 1)
    return f"{host}-{pid}"


def test_a_fenced_tenant_runs_only_in_its_region_and_nowhere_else_is_a_503(pool):
    key = pool.cli("tenants", "create", "fenced").strip().splitlines()[-1]
    assert "only in us" in pool.cli("tenants", "regions", "fenced", "--set", "us")
    fenced = httpx.Client(base_url=pool.api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    ids = [chat(fenced, SYSTEM[name], "where?") for name in ("Ada", "Brin", "Cole", "Dora")]
    assert {pool.region_of(e) for e in pool.served_on(ids)} == {"us"}

    pool.cli("tenants", "regions", "fenced", "--set", "ap")
    nowhere = pool.cli("tenants", "new-key", "fenced").strip().splitlines()[-1]  # looked up fresh: the new fence
    r = httpx.post(f"{pool.api.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {nowhere}"},
                   json=dict(model="ballast-tiny", max_tokens=4, messages=[dict(role="user", content="hi")]))
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert "in your regions (ap)" in r.json()["error"]["message"]


async def test_a_worker_killed_mid_batch_loses_nothing_its_items_finish_on_the_pool(pool, engine):
    prompts = [f"pool item {i}: tell me about the tide" for i in range(12)]
    lines = [chat_line(f"k-{i}", p, 160, ignore_eos=True) for i, p in enumerate(prompts)]
    bid = submit(pool.api, lines)
    like = f"item:{bid}:%"
    q = "SELECT count(DISTINCT stream) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
    procs.wait_until(lambda: sql(pool.data, q, s=like)[0][0] >= 6, 120, "items checkpointed", child=pool.up)
    before = set(pool.engines())
    victim = child(pool.up, "worker engine")
    os.killpg(victim, signal.SIGKILL)
    done = completed(pool.api, bid, 300)
    out = [json.loads(x) for x in pool.api.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"k-{i}" for i in range(12))  # each once
    expected = await asyncio.gather(*(greedy(engine, p, 160, ignore_eos=True) for p in prompts))
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}
    assert [got[f"k-{i}"] for i in range(12)] == expected
    # The supervisor restarts the killed one: a new engine worker joins, and the dead one's row goes stale.
    procs.wait_until(lambda: len(now := set(pool.engines())) == 2 and now - before, 180, "the pool whole again",
                     child=pool.up)


@contextmanager
def vllm_paused(pool: Pool) -> Iterator[None]:
    """Both engine workers' vLLM processes stopped (the workers themselves still serve)."""
    pids = [pid for region in ("eu", "us") for pid in descendants(engine_worker_in(pool.up, region))[1:]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def engine_worker_in(up: procs.Child, region: str) -> int:
    """The pid (and process group) of `ballast up`'s engine worker in `region`."""
    for pid in procs.children_of(up.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().replace(b"\0", b" ").rstrip().endswith(b"worker engine"):
                continue
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"BALLAST_REGION={region}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no engine worker in {region}")


async def test_a_fenced_batch_moves_to_the_other_region_of_its_fence_when_its_own_hangs(pool, engine):
    """eu's engine worker hangs (SIGSTOP: it neither works nor says so) just as a batch of
    a tenant fenced to eu and us starts there: once its groups wait unclaimed (after the
    stopped worker's heartbeat timeout, for any it had taken), they go to us; every item
    completes once, token for token vLLM's greedy output, and no group ever ran outside
    the fence."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    key = pool.cli("tenants", "create", "eu-us").strip().splitlines()[-1]
    pool.cli("tenants", "regions", "eu-us", "--set", "eu,us")
    fenced = httpx.Client(base_url=pool.api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    prompts = [f"fenced item {i}: where is the wind from" for i in range(8)]
    hung = engine_worker_in(pool.up, "eu")
    os.killpg(hung, signal.SIGSTOP)
    try:
        bid = submit(fenced, [chat_line(f"f-{i}", p, 24, ignore_eos=True) for i, p in enumerate(prompts)])
        done = completed(fenced, bid, 300)
    finally:
        os.killpg(hung, signal.SIGCONT)
    out = [json.loads(x) for x in fenced.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}
    assert len(out) == len(prompts) and [got[f"f-{i}"] for i in range(len(prompts))] == \
        await asyncio.gather(*(greedy(engine, p, 24, ignore_eos=True) for p in prompts))

    with open(f"/proc/{child(pool.up, 'api')}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    temporal = await Client.connect(env[b"BALLAST_TEMPORAL_ADDRESS"].decode())
    events = [e async for e in temporal.get_workflow_handle(f"batch:{bid}").fetch_history_events()]
    queue = {e.event_id: e.activity_task_scheduled_event_attributes.task_queue.name for e in events
             if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
             and e.activity_task_scheduled_event_attributes.activity_type.name == "generate"}
    completed_on = {queue[e.activity_task_completed_event_attributes.scheduled_event_id] for e in events
                    if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                    and e.activity_task_completed_event_attributes.scheduled_event_id in queue}
    # A region's queue (pool@eu) or one of its engine workers' own (pool@eu/host-pid).
    assert {q.rsplit("@", 1)[-1].split("/")[0] for q in queue.values()} <= {"eu", "us"}  # never outside the fence
    assert {q.rsplit("@", 1)[-1].split("/")[0] for q in completed_on} == {"us"}


def test_a_drained_engine_takes_no_new_work(pool):
    first = pool.served_on([chat(pool.api, SYSTEM["Dora"], "one?")])[0]
    assert first in pool.cli("worker", "list")
    assert "draining" in pool.cli("worker", "drain", first)
    procs.wait_until(lambda: pool.engines()[first]["draining"], 10, "the drain recorded", child=pool.up)
    time.sleep(1.5)  # the API's engine directory refreshes every 0.5 s
    health = pool.api.get("/healthz")
    assert health.status_code == 200, (health.text, pool.cli("worker", "list"))  # the other engine serves
    later = pool.served_on([chat(pool.api, SYSTEM["Dora"], f"again {i}?") for i in range(4)])
    assert first not in later and len(set(later)) == 1
    listed = [ln for ln in pool.cli("worker", "list").splitlines() if ln.startswith(first)]
    assert listed and "draining" in listed[0]
    assert pool.api.get("/healthz").status_code == 200  # the other engine serves
