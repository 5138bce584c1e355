"""A real Prometheus (the OS package) scrapes the stack's three processes (the API, the
control worker, the engine worker) with the metrics token while a tenant of its own chats,
is refused once by its limit and runs a batch. PromQL then answers what the client itself
counted (requests, tokens, the refusal) and what the journal says (the batch's items and
tokens); vLLM's own series and the Temporal SDK's are there; every scrape succeeded; and
without the token /metrics says nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest

from ballast import procs
from config.database import libpq_url
from journal import tenant_store
from journal.db import connect
from tests.e2e.conftest import Stack, make_key

pytestmark = pytest.mark.e2e

CHATS = 6
JOBS = ("ballast-api", "ballast-control", "ballast-engine")  # the job names deploy/prometheus/alerts.yml assumes


def _limit(db_url: str, tenant: str, requests_per_min: int) -> None:
    async def run() -> None:
        db = connect(db_url, pool_size=1)
        try:
            async with db.begin() as conn:
                await tenant_store.set_limits(conn, tenant, "*", requests_per_min=requests_per_min)
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture
def prometheus(stack: Stack, tmp_path: Path):
    """Prometheus scraping the stack every second: its query API's URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run `make test-deps` (`make test` does), which installs it from apt")
    token = tmp_path / "metrics-token"
    token.write_text(stack.metrics_token)
    token.chmod(0o600)
    targets = {"ballast-api": stack.url, "ballast-control": stack.control_url, "ballast-engine": stack.engine_url}
    config = {"global": dict(scrape_interval="1s", scrape_timeout="1s"), "scrape_configs": [
        dict(job_name=job, authorization=dict(type="Bearer", credentials_file=str(token)),
             static_configs=[dict(targets=[url.removeprefix("http://")])]) for job, url in targets.items()]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    port = procs.free_port()
    child = procs.spawn("prometheus", [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'data'}",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                        log_path=tmp_path / "prometheus.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert child.alive and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
        yield url
    finally:
        child.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _query(prom: str, q: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params=dict(query=q), timeout=10).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def _value(prom: str, q: str) -> float | None:
    result = _query(prom, q)
    assert len(result) <= 1, (q, result)
    return float(result[0]["value"][1]) if result else None


def _until(prom: str, want: dict[str, float], timeout: float = 60) -> None:
    """Until every query answers its value (a scrape a second), or fail saying what each said."""
    deadline = time.monotonic() + timeout
    while (got := {q: _value(prom, q) for q in want}) != want:
        assert time.monotonic() < deadline, dict(got=got, want=want)
        time.sleep(0.5)


def test_prometheus_agrees_with_the_client_and_the_journal(stack, prometheus, db_url, tiny_model):
    tenant = f"metrics-{uuid.uuid4().hex[:8]}"
    http = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {make_key(db_url, tenant)}"})
    _limit(db_url, tenant, CHATS)

    # The client's own record: what it sent, and what it was told. Chats until the limit
    # refuses one (the API's admission view takes up to a refresh to see the new limit).
    done, prompt, completion, refused = 0, 0, 0, 0
    for i in range(80):
        r = http.post("/v1/chat/completions", json=dict(model=tiny_model.name, max_tokens=4 + i % 5, temperature=0,
                                                        messages=[dict(role="user", content=f"count to {i}")]))
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            refused += 1
            break
        assert r.status_code == 200, r.text
        done += 1
        prompt += r.json()["usage"]["prompt_tokens"]
        completion += r.json()["usage"]["completion_tokens"]
        time.sleep(0.1)
    assert refused == 1 and done >= CHATS

    lines = "".join(json.dumps(dict(custom_id=f"c{i}", method="POST", url="/v1/completions",
                                    body=dict(model=tiny_model.name, prompt=f"line {i}", max_tokens=5))) + "\n"
                    for i in range(3))
    file_id = http.post("/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}).json()["id"]
    batch = http.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/completions",
                                               completion_window="24h")).json()
    deadline = time.monotonic() + 180
    while (batch := http.get(f"/v1/batches/{batch['id']}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    assert batch["status"] == "completed", batch
    with psycopg.connect(libpq_url(db_url)) as conn:
        ((items, tokens),) = conn.execute(
            "SELECT count(*) FILTER (WHERE type = 'item_completed'),"
            " coalesce(sum(jsonb_array_length(payload->'token_ids')), 0) FROM events WHERE tenant = %s", (tenant,),
        ).fetchall()
    assert items == 3 and tokens > 0

    t = f'tenant="{tenant}"'
    _until(prometheus, {
        f'sum(ballast_requests_total{{{t}, status="completed"}})': float(done),
        f'sum(ballast_tokens_total{{{t}, kind="prompt"}})': float(prompt),
        f'sum(ballast_tokens_total{{{t}, kind="completion"}})': float(completion),
        f'sum(ballast_admission_decisions_total{{{t}, decision="admitted"}})': float(done),
        f'sum(ballast_admission_decisions_total{{{t}, decision="refused", reason="requests_per_min"}})': 1.0,
        f'sum(ballast_batch_items_total{{{t}, outcome="completed"}})': float(items),
        f'sum(ballast_batch_tokens_total{{{t}}})': float(tokens),
    })
    # What the API saw of each chat, in its histograms (other tests' requests too: at least ours).
    assert _value(prometheus, f'sum(ballast_ttft_seconds_count{{model="{tiny_model.name}"}})') >= done
    assert _value(prometheus, f'sum(ballast_request_duration_seconds_count{{model="{tiny_model.name}"}})') >= done
    # vLLM's own series from the engine worker: every chat and batch line it finished.
    assert _value(prometheus, 'sum(vllm:request_success_total{job="ballast-engine"})') >= done + 3
    assert _value(prometheus, 'max(ballast_engine_max_seqs{job="ballast-engine"})') > 0
    # The Temporal SDK's, from each process that talks to Temporal; the journal's appends.
    for job in JOBS:
        assert _value(prometheus, f'sum(temporal_request{{job="{job}"}})') > 0, job
    for job in ("ballast-control", "ballast-engine"):
        assert _value(prometheus, f'sum(ballast_journal_append_seconds_count{{job="{job}"}})') > 0, job

    # The control worker's view of what waits, and the autoscaling signal from the engines'
    # announcements: the pool has its engine and wants at least one.
    assert _value(prometheus, 'max(ballast_quota_fold_age_seconds{job="ballast-control"})') < 60
    assert _value(prometheus, f'max(ballast_pool_engines{{model="{tiny_model.name}"}})') >= 1
    assert _value(prometheus, f'max(ballast_engines_wanted{{model="{tiny_model.name}"}})') >= 1

    # Every scrape of every process succeeded, and none is large.
    targets = httpx.get(prometheus + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert sorted(x["labels"]["job"] for x in targets) == sorted(JOBS)
    assert all(x["health"] == "up" and x["lastError"] == "" for x in targets), targets
    for job in JOBS:
        assert _value(prometheus, f'min_over_time(up{{job="{job}"}}[5m])') == 1.0, job
        assert _value(prometheus, f'scrape_samples_scraped{{job="{job}"}}') < 5000, job

    # Every panel of the dashboard: a query Prometheus takes, with data from this run
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/ballast.json").read_text())
    # (fine-tuning, append errors, a backlog, queued batch tokens and surges need not be there
    # at this moment on this stack).
    may_be_empty = {"Fine-tune steps /s", "Journal append errors /s", "Batch backlog: pending items by tenant",
                    "Oldest waiting batch by tenant", "Queued batch tokens by model", "Surging pools"}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            rows = _query(prometheus, target["expr"].replace("$__rate_interval", "1m"))
            assert rows or panel["title"] in may_be_empty, (panel["title"], target["expr"])

    # Without the token, or with another, no process says anything.
    for url in (stack.url, stack.control_url, stack.engine_url):
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401, url
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
