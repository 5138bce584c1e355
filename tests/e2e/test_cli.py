"""The client CLI end to end, as a user runs it: `python -m ballast.cli …` as a process of
its own, configured by the environment, against the shared stack's real API.

Oracles: the API's own objects and file contents fetched here with httpx, the responses'
`usage` as vLLM counted it, SQL over the journal, and the process's exit code and streams.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from ballast import procs
from config.database import libpq_url
from tests.e2e.conftest import make_admin_key, make_key

pytestmark = pytest.mark.e2e

N = 200


def run(stack, *args: str, key: str | None = None, admin: str | None = None, timeout: float = 300,
        cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("BALLAST_", "OPENAI_"))}
    variables.update(dict(BALLAST_BASE_URL=stack.url, BALLAST_CONFIG=str((cwd or Path.cwd()) / "no-config.toml")) | env)
    if key:
        variables["BALLAST_API_KEY"] = key
    if admin:
        variables["BALLAST_ADMIN_KEY"] = admin
    return subprocess.run([sys.executable, "-m", "ballast.cli", *args], env=variables, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def tenant_key(db_url) -> str:
    return make_key(db_url, tenant=f"cli-{uuid.uuid4().hex[:8]}", tiers=())


@pytest.fixture(scope="module")
def admin_key(db_url) -> str:
    return make_admin_key(db_url)


def _lines(n: int) -> str:
    return "".join(json.dumps(dict(custom_id=f"row-{i}", method="POST", url="/v1/completions",
                                   body=dict(model="ballast-tiny", prompt=f"Line {i}: the ballast of ship {i % 17}",
                                             max_tokens=4 + i % 5, temperature=0))) + "\n" for i in range(n))


def test_batch_submit_waits_with_progress_and_downloads_what_the_api_serves(stack, tenant_key, db_url, tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text(_lines(N))
    done = run(stack, "batch", "submit", str(src), "--wait", "--interval", "0.2", "--json", key=tenant_key,
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    batch = json.loads(done.stdout)  # --json: stdout is the batch object alone
    progress = [ln for ln in done.stderr.splitlines() if batch["id"] in ln and " completed, " in ln]
    counts = [int(ln.split(": ", 1)[1].split(" completed")[0]) for ln in progress]
    assert counts == sorted(counts) and counts[-1] == N, done.stderr
    assert any(0 < c < N for c in counts), f"no progress seen between start and end:\n{done.stderr}"
    assert progress[-1].split(" ", 2)[2].startswith("completed: ")

    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {tenant_key}"}, timeout=60) as api:
        assert api.get(f"/v1/batches/{batch['id']}").json() == batch  # the object as the API has it
        served = api.get(f"/v1/files/{batch['output_file_id']}/content").content
    out = tmp_path / "rows.output.jsonl"
    assert out.read_bytes() == served, "the downloaded output differs from the API's file"
    assert batch["error_file_id"] is None and not (tmp_path / "rows.errors.jsonl").exists()
    rows = [json.loads(ln) for ln in served.splitlines()]
    assert [r["custom_id"] for r in rows] == [f"row-{i}" for i in range(N)]
    assert batch["request_counts"] == dict(total=N, completed=N, failed=0)
    # Its tokens, as vLLM counted them in each response, and as the ledger settled them.
    usage = [r["response"]["body"]["usage"] for r in rows]
    with psycopg.connect(libpq_url(db_url)) as conn:
        settled = conn.execute("SELECT sum(input_tokens), sum(output_tokens) FROM ledger WHERE kind = 'settle' "
                               "AND subject LIKE %s", (f"item:{batch['id']}:%",)).fetchone()
    assert (batch["ballast"]["input_tokens"], batch["ballast"]["output_tokens"]) == (
        sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage)) == tuple(settled)
    assert batch["ballast"]["output_tokens_per_s"] > 0 and batch["ballast"]["estimated_completion"] is None

    listed = run(stack, "--json", "batch", "list", "--limit", "5", key=tenant_key, cwd=tmp_path)
    assert listed.returncode == 0 and json.loads(listed.stdout)["data"][0] == batch
    table = run(stack, "batch", "list", key=tenant_key, cwd=tmp_path)
    assert table.returncode == 0 and batch["id"] in table.stdout and f"{N}/{N}" in table.stdout
    files = run(stack, "files", "list", "--purpose", "batch_output", "--json", key=tenant_key, cwd=tmp_path)
    assert batch["output_file_id"] in [f["id"] for f in json.loads(files.stdout)["data"]]
    again = run(stack, "files", "download", batch["output_file_id"], "-o", str(tmp_path / "again.jsonl"),
                key=tenant_key, cwd=tmp_path)
    assert again.returncode == 0 and (tmp_path / "again.jsonl").read_bytes() == served

    # Usage through the API, as the audit view counts it (the SQL above is the oracle).
    since = str(batch["created_at"] - 86400)
    used = json.loads(run(stack, "usage", "--since", since, "--by", "tier", "--json", key=tenant_key,
                          cwd=tmp_path).stdout)
    tiers = {}
    for b in used["data"]:
        for r in b["results"]:
            tiers[r["service_tier"]] = tiers.get(r["service_tier"], 0) + r["output_tokens"]
    assert tiers == {"batch": settled[1]}
    shown = run(stack, "usage", "--since", since, "--by", "tier", key=tenant_key, cwd=tmp_path)
    assert shown.returncode == 0 and str(settled[1]) in shown.stdout


def test_exit_codes_are_as_documented(stack, tenant_key, tmp_path, gate):
    assert "Exit codes:" in run(stack, "--help").stdout
    assert run(stack, "--version").stdout.startswith("ballast ")
    missing = run(stack, "batch", "get", "batch_" + "0" * 24, key=tenant_key, cwd=tmp_path)
    assert missing.returncode == 3 and "404" in missing.stderr and "No batch found" in missing.stderr
    assert run(stack, "batch", "get", "batch_x", key="sk-ballast-" + "x" * 43, cwd=tmp_path).returncode == 4
    assert run(stack, "batch", "list", cwd=tmp_path).returncode == 4  # no key at all: said, not sent
    dead = run(stack, "models", "list", key=tenant_key, cwd=tmp_path,
               BALLAST_BASE_URL=f"http://127.0.0.1:{procs.free_port()}")
    assert dead.returncode == 5 and "cannot reach" in dead.stderr
    assert run(stack, "batch", "frobnicate").returncode == 2
    src = tmp_path / "one.jsonl"
    src.write_text(_lines(3))
    refused = run(stack, "batch", "submit", str(src), "--window", "7d", key=tenant_key, cwd=tmp_path)
    assert refused.returncode == 3 and "completion_window" in refused.stderr

    # A batch cancelled while it is followed: `batch wait` ends 1, and says how it ended.
    gate.hold(1)
    made = run(stack, "--json", "batch", "submit", str(src), key=tenant_key, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    batch_id = json.loads(made.stdout)["id"]
    waiting = subprocess.Popen([sys.executable, "-m", "ballast.cli", "batch", "wait", batch_id, "--interval", "0.2"],
                               env=dict(os.environ, BALLAST_BASE_URL=stack.url, BALLAST_API_KEY=tenant_key),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        time.sleep(1)
        cancelled = run(stack, "batch", "cancel", batch_id, key=tenant_key, cwd=tmp_path)
        assert cancelled.returncode == 0 and "cancelling" in cancelled.stdout
        gate.release()
        stdout, stderr = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 1, stderr
    assert "cancelled" in stdout


def test_ft_create_follows_steps_and_losses_as_the_api_reports_them(stack, tenant_key, tmp_path):
    def chats(seed: int, n: int) -> str:
        return "".join(json.dumps(dict(messages=[dict(role="user", content=f"Colour {seed + i}?"),
                                                 dict(role="assistant", content=["red", "green", "blue"][i % 3])]))
                       + "\n" for i in range(n))

    (tmp_path / "train.jsonl").write_text(chats(0, 10))
    (tmp_path / "valid.jsonl").write_text(chats(100, 10))
    done = run(stack, "--json", "ft", "create", "train.jsonl", "--model", "ballast-tiny", "--validation",
               "valid.jsonl", "--epochs", "2", "--batch-size", "4", "--seed", "3", "--follow", "--interval", "0.5",
               key=tenant_key, cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    job = json.loads(done.stdout)
    assert job["status"] == "succeeded" and job["fine_tuned_model"]
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {tenant_key}"}) as api:
        assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job
        events = api.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params=dict(limit=100)).json()["data"]
    steps = [e["data"] for e in reversed(events) if "step" in (e.get("data") or {})]
    assert steps and all(d.get("valid_loss") is not None for d in steps)
    # Each step as the CLI showed it is the step, total, train and validation loss the API's events carry.
    shown = [ln.split(" ", 2)[2] for ln in done.stderr.splitlines() if " step " in f" {ln}" and "train loss" in ln]
    assert shown == [f"step {d['step']}/{d['total_steps']} · train loss {d['train_loss']:.4f} · validation loss "
                     f"{d['valid_loss']:.4f}" for d in steps], done.stderr
    listed = json.loads(run(stack, "--json", "ft", "checkpoints", job["id"], key=tenant_key, cwd=tmp_path).stdout)
    assert [c["step_number"] for c in listed["data"]] == sorted((d["step"] for d in steps), reverse=True)[:10]


def test_webhooks_are_registered_listed_and_deleted(stack, tenant_key, tmp_path):
    made = run(stack, "--json", "webhooks", "create", "https://hooks.example.com/ballast", "--event", "batch.completed",
               key=tenant_key, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    hook = json.loads(made.stdout)
    assert hook["secret"].startswith("whsec_") and hook["events"] == ["batch.completed"]
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {tenant_key}"}) as api:
        listed = json.loads(run(stack, "--json", "webhooks", "list", key=tenant_key, cwd=tmp_path).stdout)
        assert listed == api.get("/v1/webhooks").json() and "secret" not in listed["data"][0]
        assert run(stack, "webhooks", "delete", hook["id"], key=tenant_key, cwd=tmp_path).returncode == 0
        assert api.get(f"/v1/webhooks/{hook['id']}").status_code == 404
    plain = run(stack, "webhooks", "create", "ftp://nowhere", key=tenant_key, cwd=tmp_path)
    assert plain.returncode == 3 and "url" in plain.stderr


def test_admin_over_http_needs_no_database(stack, admin_key, tenant_key, tmp_path):
    """Tenants, limits, tiers, regions and the engine workers, with an admin key alone."""
    name = f"cli-made-{uuid.uuid4().hex[:6]}"
    made = run(stack, "admin", "tenants", "create", name, "--tiers", "priority", admin=admin_key, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    new_key = made.stdout.strip()  # the key alone on stdout: KEY=$(ballast admin tenants create …)
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {new_key}"}) as api:
        assert api.get("/v1/models").status_code == 200
    limits = run(stack, "admin", "limits", name, "--set", "tokens_per_day=5000", "--set", "requests_per_min=7",
                 "--json", admin=admin_key, cwd=tmp_path)
    (row,) = json.loads(limits.stdout)["data"]
    assert (row["model"], row["tokens_per_day"], row["requests_per_min"]) == ("*", 5000, 7)
    mine = json.loads(run(stack, "--json", "admin", "regions", name, "--set", "eu-west", admin=admin_key,
                          cwd=tmp_path).stdout)
    assert mine["regions"] == ["eu-west"] and mine["tiers"] == ["priority"]
    assert json.loads(run(stack, "--json", "admin", "tiers", name, "--set", "", admin=admin_key,
                          cwd=tmp_path).stdout)["tiers"] == []
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {admin_key}"}) as api:
        (t,) = [t for t in api.get("/admin/tenants").json()["data"] if t["id"] == name]
    assert (t["regions"], t["tiers"]) == (["eu-west"], [])
    keys = json.loads(run(stack, "--json", "admin", "keys", "list", name, admin=admin_key, cwd=tmp_path).stdout)
    assert len(keys["data"]) == 1 and new_key.startswith(keys["data"][0]["prefix"])
    assert run(stack, "admin", "tenants", "list", key=tenant_key, cwd=tmp_path).returncode == 4  # not an admin

    # The engine worker: listed with its load, drained (it stops polling), undrained (it
    # polls again and runs a batch), as its own /readyz says.
    engines = json.loads(run(stack, "--json", "admin", "engines", "list", admin=admin_key, cwd=tmp_path).stdout)
    (engine,) = [e for e in engines["data"] if e["url"] == stack.engine_url]
    assert engine["state"] == "serving" and engine["model"] == "ballast-tiny"

    def polling() -> bool:
        return httpx.get(stack.engine_url + "/readyz", timeout=5).json()["parts"]["workers"] == "ok"

    def until(cond, what: str) -> None:
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    assert polling()
    try:
        drained = run(stack, "--json", "admin", "engines", "drain", engine["id"], admin=admin_key, cwd=tmp_path)
        assert json.loads(drained.stdout)["state"] == "draining"
        until(lambda: not polling(), "the drained engine worker still polls")
    finally:
        undrained = run(stack, "--json", "admin", "engines", "undrain", engine["id"], admin=admin_key, cwd=tmp_path)
    assert json.loads(undrained.stdout)["state"] == "serving"
    until(polling, "the undrained engine worker does not poll again")
    src = tmp_path / "after.jsonl"
    src.write_text(_lines(2))
    after = run(stack, "batch", "submit", str(src), "--wait", "--interval", "0.2", key=tenant_key, cwd=tmp_path)
    assert after.returncode == 0, after.stderr
