"""`ballast up` keeps its children running: the engine worker SIGKILLed mid-batch is
restarted (it says so, with the exit code) and the batch completes with every item once,
token-for-token vLLM's greedy output; the API SIGKILLed is restarted and serves again.
`ballast up` itself never stops. "Mid-batch" is a fact: the engine gate holds every item
mid-generation when the kill comes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from ballast import procs
from journal.db import libpq_url
from tests.e2e.conftest import Gate
from tests.e2e.test_batch import chat_line, greedy
from tests.e2e.test_up import start_up, up_env, wait_healthy

pytestmark = pytest.mark.e2e

N, LENGTH, HELD_AT = 6, 120, 40


def child(up: procs.Child, args: str) -> int:
    """The pid of `ballast up`'s child running `ballast.cli <args>`."""
    for pid in procs.children_of(up.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().replace(b"\0", b" ").decode().rstrip().endswith(f"ballast.cli {args}"):
                return pid
    raise AssertionError(f"no child runs {args!r}")


@pytest.fixture
def up_dir():
    d = Path(tempfile.mkdtemp(prefix="ballast-test-supervise-"))  # short: Postgres's socket path
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sql(up_dir: Path, q: str, **params) -> list[tuple]:
    with psycopg.connect(libpq_url((up_dir / "postgres-url").read_text().strip())) as conn:
        return conn.execute(q, params).fetchall()


def said(log: Path, text: str, up: procs.Child, timeout: float = 60) -> None:
    procs.wait_until(lambda: text in log.read_text(), timeout, f"`ballast up` to say {text!r}", child=up)


async def test_a_killed_engine_worker_and_api_are_restarted_and_the_batch_completes_once(tmp_path, up_dir,
                                                                                            tiny_model, engine):
    # Blocking calls throughout, on purpose: nothing else runs on this loop until the
    # reference outputs at the end.
    env, port = up_env(up_dir, tiny_model, BALLAST_HEARTBEAT_TIMEOUT_S="3",
                       BALLAST_ENGINE_GATE=str(tmp_path / "gate.json"))
    gate = Gate(tmp_path / "gate.json")
    gate.hold(HELD_AT)
    log = tmp_path / "up.log"
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    up = start_up(env, log)
    try:
        wait_healthy(api, up)
        api.headers["Authorization"] = "Bearer " + (up_dir / "api-key").read_text().strip()
        prompts = [f"supervised {i}: tell me about the sea" for i in range(N)]
        lines = "".join(json.dumps(chat_line(f"s-{i}", p, LENGTH, ignore_eos=True)) + "\n"
                        for i, p in enumerate(prompts))
        fid = api.post("/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}).json()["id"]
        bid = api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/chat/completions",
                                                completion_window="24h")).json()["id"]
        like = f"item:{bid}:%"
        held = "SELECT count(DISTINCT stream) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
        procs.wait_until(lambda: sql(up_dir, held, s=like)[0][0] == N, 120, "every item checkpointed", child=up)

        os.killpg(child(up, "worker engine"), signal.SIGKILL)
        said(log, "engine worker exited (code -9); restarting in", up)
        assert sql(up_dir, "SELECT count(*) FROM events WHERE type = 'item_completed' AND stream LIKE %(s)s",
                   s=like) == [(0,)]  # the kill landed mid-batch
        gate.release()
        said(log, "engine worker restarted", up)
        deadline = time.monotonic() + 240
        while (b := api.get(f"/v1/batches/{bid}").json())["status"] != "completed":
            assert time.monotonic() < deadline and b["status"] not in ("failed", "cancelled", "expired"), b
            time.sleep(0.5)
        out = [json.loads(x) for x in api.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"s-{i}" for i in range(N)]  # each once
        dupes = sql(up_dir, "SELECT stream, payload->>'offset' FROM events WHERE type = 'item_chunk' "
                              "AND stream LIKE %(s)s GROUP BY 1, 2 HAVING count(*) > 1", s=like)
        assert dupes == []
        expected = await asyncio.gather(*(greedy(engine, p, LENGTH, ignore_eos=True) for p in prompts))
        assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected

        os.killpg(child(up, "api"), signal.SIGKILL)
        said(log, "api exited (code -9); restarting in", up)
        said(log, "api restarted", up)
        wait_healthy(api, up)
        chat = api.post("/v1/chat/completions", json=dict(model=tiny_model.name, max_tokens=4,
                                                          messages=[dict(role="user", content="still there?")]))
        assert chat.status_code == 200, chat.text
        assert up.alive
    finally:
        up.stop(60)

