"""`ballast up` as a benchmark arm: a fresh stack in a temporary directory, on the very
model the in-process arms run, with its own embedded Postgres (nothing else is touched)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy.engine import URL

from ballast import procs
from ballast.pg import PASSWORD_FILE, PG_USER
from config import Settings


@dataclass
class Stack:
    api: httpx.Client
    temporal_address: str
    db_url: str  # its embedded Postgres, for reading the journal back
    # What its engine worker's own endpoint (/stats, /v1/generate) demands: the engine token.
    engine_headers: dict[str, str]
    pid: int  # `ballast up`'s: every process of the stack runs under it


KEEP_LOGS_ENV = "BALLAST_BENCH_KEEP_LOGS"  # set: every run keeps its stack's logs, not only a failed one


@contextmanager
def ballast_up(settings: Settings, data_dir: Path, **extra_env: str) -> Iterator[Stack]:
    from engine.model_spec import resolve_model

    spec = resolve_model(settings)
    port, temporal_port = procs.free_port(), procs.free_port()
    env = dict(os.environ, BALLAST_DATA_DIR=str(data_dir), BALLAST_API_PORT=str(port),
               BALLAST_TEMPORAL_PORT=str(temporal_port), BALLAST_TEMPORAL_UI_PORT=str(procs.free_port()),
               BALLAST_MODEL=spec.path, BALLAST_SERVED_MODEL_NAME=spec.name, **extra_env)
    for own_db in ("DATABASE_URL", "BALLAST_DATABASE_URL"):
        env.pop(own_db, None)
    up = procs.spawn("ballast up", [sys.executable, "-m", "ballast.cli", "up"], env=env, log_path=data_dir / "up.log")
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        procs.wait_until(lambda: _healthy(api), 300, "ballast up to be healthy", child=up, interval=0.5)
        # The key `ballast up` made for tenant `default` on this fresh data dir.
        api.headers["Authorization"] = "Bearer " + (data_dir / "api-key").read_text().strip()
        pg_port = int((data_dir / "pg.port").read_text().strip())
        # Its superuser logs in with the password the embedded server keeps beside its cluster.
        password = (data_dir / PASSWORD_FILE).read_text().strip()
        db_url = URL.create("postgresql", PG_USER, password, "127.0.0.1", pg_port, "postgres")
        # BALLAST_ENGINE_TOKEN where given; else the one `ballast up` made in the data dir.
        token = env.get("BALLAST_ENGINE_TOKEN", "").strip() or (data_dir / "engine-token").read_text().strip()
        yield Stack(api, f"127.0.0.1:{temporal_port}", db_url.render_as_string(hide_password=False),
                    {"Authorization": f"Bearer {token}"}, up.pid)
    except BaseException:
        _keep_logs(data_dir)
        raise
    else:
        if os.environ.get(KEEP_LOGS_ENV):
            _keep_logs(data_dir)
    finally:
        api.close()
        up.stop(60)


def _keep_logs(data_dir: Path) -> None:
    """A run that failed (or any, with BALLAST_BENCH_KEEP_LOGS set) keeps its stack's logs
    (its data dir is a temporary one), and says where."""
    kept = Path(".ballast") / "bench-logs" / time.strftime("%Y%m%d-%H%M%S")
    for log in [data_dir / "up.log", *(data_dir / "logs").glob("*.log")]:
        if log.is_file():
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copy2(log, kept / log.name)
    if kept.exists():
        print(f"the stack's logs are kept in {kept}", file=sys.stderr)


def _healthy(api: httpx.Client) -> bool:
    try:
        return api.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False
