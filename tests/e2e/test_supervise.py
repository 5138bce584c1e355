"""`ballast up` keeps its processes running: the engine worker SIGKILLed mid-batch is
restarted (it says so, with the exit code) and the batch completes with every item once,
token-for-token vLLM's greedy output; the API SIGKILLed is restarted and serves again; the
embedded Postgres and Temporal server SIGKILLed come back on their ports, with their
state, and every service serves again. `ballast up` itself never stops. "Mid-batch" is a
fact: the engine gate holds every item mid-generation when the kill comes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from ballast import procs
from config.database import libpq_url
from tests.e2e.conftest import Gate
from tests.e2e.test_batch import chat_line, greedy
from tests.e2e.test_up import start_up, up_env, wait_healthy

pytestmark = pytest.mark.e2e

N, LENGTH, HELD_AT = 6, 120, 40


def child(up: procs.Child, args: str) -> int:
    """The pid of `ballast up`'s child whose command line ends with `args`, or holds it."""
    for pid in procs.children_of(up.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode().rstrip()
        if cmd.endswith(f"ballast.cli {args}") or f" {args} " in f" {cmd} ":
            return pid
    raise AssertionError(f"no child runs {args!r}")


def sql(up_dir: Path, q: str, **params) -> list[tuple]:
    with psycopg.connect(libpq_url((up_dir / "postgres-url").read_text().strip())) as conn:
        return conn.execute(q, params).fetchall()


def submit(api: httpx.Client, lines: list[dict]) -> str:
    body = "".join(json.dumps(ln) + "\n" for ln in lines)
    fid = api.post("/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}).json()["id"]
    return api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/chat/completions",
                                             completion_window="24h")).json()["id"]


def completed(api: httpx.Client, bid: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (b := api.get(f"/v1/batches/{bid}").json())["status"] != "completed":
        assert time.monotonic() < deadline and b["status"] not in ("failed", "cancelled", "expired"), b
        time.sleep(0.5)
    return b


def started(tmp_path: Path, up_dir: Path, tiny_model, **extra: str) -> tuple[procs.Child, httpx.Client, Path]:
    """`ballast up` in `up_dir`, healthy; a client with its key; its log."""
    env, port = up_env(up_dir, tiny_model, **extra)
    log = tmp_path / "up.log"
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    up = start_up(env, log)
    try:
        wait_healthy(api, up)
    except BaseException:
        up.stop(60)
        raise
    api.headers["Authorization"] = "Bearer " + (up_dir / "api-key").read_text().strip()
    return up, api, log


def said(log: Path, text: str, up: procs.Child, timeout: float = 60) -> None:
    procs.wait_until(lambda: text in log.read_text(), timeout, f"`ballast up` to say {text!r}", child=up)


async def test_a_killed_engine_worker_and_api_are_restarted_and_the_batch_completes_once(tmp_path, up_dir,
                                                                                            tiny_model, engine):
    # Blocking calls throughout, on purpose: nothing else runs on this loop until the
    # reference outputs at the end.
    gate = Gate(tmp_path / "gate.json")
    gate.hold(HELD_AT)
    up, api, log = started(tmp_path, up_dir, tiny_model, BALLAST_HEARTBEAT_TIMEOUT_S="3",
                           BALLAST_ENGINE_GATE=str(tmp_path / "gate.json"))
    try:
        prompts = [f"supervised {i}: tell me about the sea" for i in range(N)]
        bid = submit(api, [chat_line(f"s-{i}", p, LENGTH, ignore_eos=True) for i, p in enumerate(prompts)])
        like = f"item:{bid}:%"
        held = "SELECT count(DISTINCT stream) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
        procs.wait_until(lambda: sql(up_dir, held, s=like)[0][0] == N, 120, "every item checkpointed", child=up)

        os.killpg(child(up, "worker engine"), signal.SIGKILL)
        said(log, "engine worker exited (code -9); restarting in", up)
        assert sql(up_dir, "SELECT count(*) FROM events WHERE type = 'item_completed' AND stream LIKE %(s)s",
                   s=like) == [(0,)]  # the kill landed mid-batch
        gate.release()
        said(log, "engine worker restarted", up)
        b = completed(api, bid, 240)
        out = [json.loads(x) for x in api.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"s-{i}" for i in range(N)]  # each once
        dupes = sql(up_dir, "SELECT stream, payload->>'offset' FROM events WHERE type = 'item_chunk' "
                              "AND stream LIKE %(s)s GROUP BY 1, 2 HAVING count(*) > 1", s=like)
        assert dupes == []
        expected = await asyncio.gather(*(greedy(engine, p, LENGTH, ignore_eos=True) for p in prompts))
        assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected

        killed_and_back(up, api, log, "api", "api")
        assert up.alive
    finally:
        up.stop(60)


def killed_and_back(up: procs.Child, api: httpx.Client, log: Path, name: str, args: str) -> None:
    """SIGKILL a child of `ballast up`: it says so and starts it again; then every part is
    healthy again (the others reconnected) and a chat is served."""
    os.killpg(child(up, args), signal.SIGKILL)
    said(log, f"{name} exited (code -9); restarting in", up)
    said(log, f"{name} restarted", up, timeout=120)
    wait_healthy(api, up)
    chat = api.post("/v1/chat/completions", json=dict(model="ballast-tiny", max_tokens=4,
                                                      messages=[dict(role="user", content="still there?")]))
    assert chat.status_code == 200, chat.text


def run_batch(api: httpx.Client, tag: str) -> None:
    b = completed(api, submit(api, [chat_line(f"{tag}-{i}", f"{tag} {i}", 8) for i in range(2)]), 120)
    assert b["request_counts"] == dict(total=2, completed=2, failed=0), b


def test_the_embedded_postgres_and_temporal_server_are_restarted_and_everything_serves_again(tmp_path, up_dir,
                                                                                              tiny_model):
    up, api, log = started(tmp_path, up_dir, tiny_model)
    try:
        run_batch(api, "before")
        for name, args in (("embedded postgres", "-D"), ("temporal dev server", "start-dev")):
            killed_and_back(up, api, log, name, args)
            run_batch(api, f"after-{args}")
        assert up.alive
    finally:
        up.stop(60)
