"""A real Prometheus (the OS package, with deploy/prometheus' rules) scrapes the stack's
three processes (the API, the control worker, the engine worker) with the metrics token
while a tenant of its own fine-tunes, chats, is refused once by its limit and runs a batch
that a surge of chats preempts. PromQL then answers what the client itself counted
(requests, tokens, the refusal, its use of its limits) and what the journal says (the
batch's items and tokens, its preemptions and what resuming them prefilled again, the
fine-tune's steps and loss); vLLM's own series and the Temporal SDK's are there; every
scrape succeeded and every rule evaluates; and without the token /metrics says nothing."""

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
from tests.e2e.test_interactive import Surges

pytestmark = pytest.mark.e2e

CHATS = 6
JOBS = ("ballast-api", "ballast-control", "ballast-engine")  # the job names deploy/prometheus/alerts.yml assumes


def _limit(db_url: str, tenant: str, **dims: int) -> None:
    async def run() -> None:
        db = connect(db_url, pool_size=1)
        try:
            async with db.begin() as conn:
                await tenant_store.set_limits(conn, tenant, "*", **dims)
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
    rules = Path(__file__).resolve().parents[2] / "deploy/prometheus/alerts.yml"
    config = {"global": dict(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s"),
              "rule_files": [str(rules)], "scrape_configs": [
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


def test_prometheus_agrees_with_the_client_and_the_journal(stack, gate, prometheus, db_url, tiny_model):
    started = time.monotonic()
    tenant = f"metrics-{uuid.uuid4().hex[:8]}"
    key = make_key(db_url, tenant)
    http = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {key}"})
    _limit(db_url, tenant, requests_per_min=CHATS, tokens_per_day=10**9)
    # A fine-tune trains meanwhile, in the engine's batch slots (3 steps).
    examples = "".join(json.dumps(dict(messages=[dict(role="user", content=f"Colour {i}?"),
                                                 dict(role="assistant", content="blue")])) + "\n" for i in range(10))
    training = http.post("/v1/files", files={"file": ("train.jsonl", examples)}, data={"purpose": "fine-tune"})
    job = http.post("/v1/fine_tuning/jobs", json=dict(model=tiny_model.name, training_file=training.json()["id"],
                                                     hyperparameters=dict(n_epochs=1, batch_size=4))).json()

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

    # A batch held by the engine gate short of its end until a surge of chats (another
    # tenant's) has preempted some of it; then on to the end.
    def sql(query: str) -> list[tuple]:
        with psycopg.connect(libpq_url(db_url)) as conn:
            return conn.execute(query, (tenant,)).fetchall()

    reprefilled_before = _value(prometheus, "sum(ballast_batch_reprefilled_tokens_total)") or 0.0
    gate.hold(20)
    lines = "".join(json.dumps(dict(custom_id=f"c{i}", method="POST", url="/v1/completions",
                                    body=dict(model=tiny_model.name, prompt=f"line {i}", max_tokens=40,
                                              ignore_eos=True))) + "\n" for i in range(12))
    file_id = http.post("/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}).json()["id"]
    batch = http.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/completions",
                                               completion_window="24h")).json()
    deadline = time.monotonic() + 180
    with Surges(stack, gaps=(0.3, 0.9), burst=3):
        while sql("SELECT count(*) FROM events WHERE tenant = %s AND type = 'item_preempted'")[0][0] == 0:
            assert time.monotonic() < deadline, "no preemption"
            time.sleep(0.05)
        gate.release()
    while (batch := http.get(f"/v1/batches/{batch['id']}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    assert batch["status"] == "completed", batch
    ((items, tokens, preempted),) = sql(
        "SELECT count(*) FILTER (WHERE type = 'item_completed'),"
        " coalesce(sum(jsonb_array_length(payload->'token_ids')), 0), count(*) FILTER (WHERE type = 'item_preempted')"
        " FROM events WHERE tenant = %s AND stream LIKE 'item:%%'")
    assert items == 12 and tokens == 12 * 40 and preempted >= 1
    # What resuming cost, from the journal: each preemption's item prefilled again, its
    # prompt and the tokens it had journaled (at least: the same offset may yield twice).
    # (Read out of the body's text: a completion of the tiny model's bytes may hold a NUL,
    # which Postgres' jsonb refuses.)
    ((again,),) = sql("""SELECT sum(substring(c.payload->>'body_json' FROM '"prompt_tokens": *([0-9]+)')::int
                                  + (p.payload->>'offset')::int)
                           FROM events p JOIN events c ON c.stream = p.stream AND c.type = 'item_completed'
                          WHERE p.tenant = %s AND p.type = 'item_preempted'""")

    deadline = time.monotonic() + 240
    while (job := http.get(f"/v1/fine_tuning/jobs/{job['id']}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    assert job["status"] == "succeeded", job
    ((steps, loss),) = sql("SELECT max((payload->>'step')::int), (array_agg(payload->'losses'->>-1 ORDER BY "
                           "(payload->>'step')::int DESC))[1] FROM events WHERE tenant = %s AND type = 'ft_checkpoint'")
    ((trained,),) = sql("SELECT sum(input_tokens + output_tokens) FROM ledger WHERE tenant = %s AND tier = 'training'"
                        " AND kind = 'settle'")
    assert steps == 3 and trained == job["trained_tokens"]

    t = f'tenant="{tenant}"'
    _until(prometheus, {
        f'sum(ballast_requests_total{{{t}, status="completed"}})': float(done),
        f'sum(ballast_tokens_total{{{t}, kind="prompt"}})': float(prompt),
        f'sum(ballast_tokens_total{{{t}, kind="completion"}})': float(completion),
        f'sum(ballast_admission_decisions_total{{{t}, decision="admitted"}})': float(done),
        f'sum(ballast_admission_decisions_total{{{t}, decision="refused", reason="requests_per_min"}})': 1.0,
        f'sum(ballast_batch_items_total{{{t}, outcome="completed"}})': float(items),
        f'sum(ballast_batch_tokens_total{{{t}}})': float(tokens),
        f'sum(ballast_fine_tune_steps_total{{{t}}})': float(steps),
        # Its use of its limits, as the control worker reads the fold: the day's tokens are
        # its chats' (the client's count) and its training's (the ledger's settles).
        f'max(ballast_quota_limit{{{t}, model="*", limit="tokens_per_day"}})': float(10**9),
        f'max(ballast_quota_used{{{t}, model="*", limit="tokens_per_day"}})': float(prompt + completion + trained),
        f'max(ballast_quota_limit{{{t}, model="*", limit="requests_per_min"}})': float(CHATS),
    }, timeout=90)
    assert _value(prometheus, f'max(ballast_fine_tune_loss{{{t}, split="train"}})') == pytest.approx(float(loss))
    assert _value(prometheus, f'sum(ballast_batch_items_total{{{t}, outcome="preempted"}})') >= preempted
    assert _value(prometheus, "sum(ballast_batch_reprefilled_tokens_total)") - reprefilled_before >= again > 0
    assert _value(prometheus, 'sum(ballast_checkpoint_lag_seconds_count{job="ballast-engine"})') > 0
    assert _value(prometheus, f'max(ballast_engine_info{{model="{tiny_model.name}"}})') == 1
    jain = _value(prometheus, f'model:ballast_served_weighted_tokens:jain_rate1m{{model="{tiny_model.name}"}}')
    assert jain is None or 0 < jain <= 1  # None: no chat in the last minute
    # Every rule of deploy/prometheus evaluates against the real series, without error.
    groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert groups and all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
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

    # Every panel of the dashboard: a query Prometheus takes, with data from this run (its
    # rates over the whole run, not a minute: on a busy machine the last minute may have seen
    # no chat of this test, and a stalled scrape loop leaves a short window empty).
    run = f"{int(time.monotonic() - started) + 5}s"
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/ballast.json").read_text())
    # (fine-tuning, append errors, a backlog, queued batch tokens and surges need not be there
    # at this moment on this stack).
    may_be_empty = {"Fine-tune steps /s", "Journal append errors /s", "Batch backlog: pending items by tenant",
                    "Oldest waiting batch by tenant", "Queued batch tokens by model", "Surging pools"}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            rows = _query(prometheus, target["expr"].replace("$__rate_interval", run))
            assert rows or panel["title"] in may_be_empty, (
                panel["title"], target["expr"], _query(prometheus, f"count_over_time(up[{run}])"))

    # The engine worker's probes ask no token: vLLM answers and its workers poll.
    assert httpx.get(stack.engine_url + "/healthz", timeout=10).json() == dict(status="ok")
    ready = httpx.get(stack.engine_url + "/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["parts"] == dict(vllm="ok", workers="ok"), ready.text

    # Without the token, or with another, no process says anything.
    for url in (stack.url, stack.control_url, stack.engine_url):
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401, url
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
