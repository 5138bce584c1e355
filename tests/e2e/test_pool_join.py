"""An engine worker joins the pool from elsewhere with nothing but the addresses and the
engine token: another working directory, another data dir, its own model cache (it builds
the tiny model itself), its own region. It serves: a tenant fenced to its region is placed
there, and gets vLLM's own greedy output (the engine fixture's, on the model the test
session built), so the model it built is the same model. Stopped, it journals the record
of what it served that its checkpointer's next tick would have (here: not before an hour)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from ballast import procs
from config.database import libpq_url
from tests.e2e.conftest import make_key, own_stack
from tests.e2e.test_batch import greedy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pool(tmp_path_factory, pg_server_url, temporal_address, tiny_model):
    with own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "join") as (stack, url):
        yield stack, url


async def test_an_engine_worker_from_another_host_joins_and_serves(pool, tiny_model, engine):
    stack, url = pool
    elsewhere = Path(tempfile.mkdtemp(prefix="ballast-test-elsewhere-"))
    keep = ("BALLAST_TEMPORAL_ADDRESS", "BALLAST_ENGINE_TOKEN", "BALLAST_ENGINE_QUEUE",
            "BALLAST_MAX_MODEL_LEN", "BALLAST_KV_CACHE_GIB")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_") and k != "DATABASE_URL"}
    env.update({k: stack.env[k] for k in keep}, BALLAST_DATABASE_URL=stack.db_urls["engine"],
               BALLAST_DATA_DIR=str(elsewhere / "data"), BALLAST_REGION="far",
               BALLAST_ENGINE_PORT=str(procs.free_port()), BALLAST_CHECKPOINT_INTERVAL_S="3600")
    joined = procs.spawn("joined", [sys.executable, "-m", "ballast.cli", "worker", "engine"],
                         env=env, cwd=elsewhere, log_path=elsewhere / "engine.log")
    try:
        def live() -> dict[str, str]:
            with psycopg.connect(libpq_url(url)) as c:
                rows = c.execute("SELECT id, stats->>'region' FROM engines WHERE seen_at > now() - interval '5 s'")
                return dict(rows.fetchall())

        procs.wait_until(lambda: "far" in live().values(), 240, "the joined engine worker announced", child=joined)
        assert (elsewhere / "data" / "models").is_dir()  # it built its own model
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute("INSERT INTO tenants (id, regions) VALUES ('faraway', ARRAY['far'])")
        key = make_key(url, "faraway")
        prompt = "a far port, and what it trades"
        body = dict(model="ballast-tiny", max_tokens=24, temperature=0, messages=[dict(role="user", content=prompt)])
        deadline = time.monotonic() + 10  # the API's engine directory catches up within a refresh (0.5 s)
        while (r := httpx.post(f"{stack.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               timeout=120, json=body)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        q = "SELECT engine_id FROM served_requests WHERE request_id = %s"

        def served_by() -> str | None:
            with psycopg.connect(libpq_url(url)) as c:
                row = c.execute(q, (rid,)).fetchone()
            return row[0] if row else None

        [far] = [e for e, region in live().items() if region == "far"]
        assert r.json()["choices"][0]["message"]["content"] == await greedy(engine, prompt, 24)
        assert json.loads(r.text)["model"] == "ballast-tiny"
        time.sleep(2)  # the engine's stream has ended; its record waits for the next tick
        assert served_by() is None
        assert joined.stop(60) == 0
        assert served_by() == far  # journaled on the way out
    finally:
        joined.stop(30)
        shutil.rmtree(elsewhere, ignore_errors=True)
