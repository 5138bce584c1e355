"""The real stack as processes: engine worker (vLLM), control worker and API, on the test's
Postgres database and Temporal dev server. Shared by every end-to-end test.

No test here depends on how fast the engine runs. A test that needs batch work in flight
at a moment holds it there with the engine gate (`stack.gate`, engine/gate.py: every
engine worker of a stack runs with one, unlimited unless a test holds) and waits for the
state it needs as the engine reports it (`stack.wait_held`, `stack.wait_stats`) or as the
journal records it, never for a guessed while.

Every /v1 call needs an API key: each stack makes one, of tenant `default`, in its
database (`stack.key`); `stack.http()` and the `client` fixture send it. The engine worker's
own endpoint needs the stack's engine token (`stack.engine_headers`; `stack.stats()` sends it).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from ballast import pg, procs
from ballast.cpus import descendants
from config.database import SERVICE_ROLES
from journal import tenant_store
from journal.db import connect
from tests.conftest import migrate, role_url_for

UPLOAD_LIMIT = 256 * 1024
WAIT_S = 240  # how long a wait on an observed state may take before the test fails: a hang guard, not a speed bet


class Gate:
    """The engine gate's control file: hold the stack's batch generations at token budgets.

    A budget counts an item's total tokens (journaled + produced); at it the item's
    generation waits, still holding its batch slot, until the budget grows or it is
    preempted or cancelled (then it journals exactly the budget). Written atomically.
    """

    def __init__(self, path: Path):
        self.path = path
        self.release()

    def hold(self, budget: int | Mapping[str, int | None]) -> None:
        """`budget`: a token count for every batch item, or counts by item stream
        (`journal.batch_store.item_stream`) with an optional "default" for the others."""
        self._write(budget if isinstance(budget, int) else dict(budget))

    def release(self) -> None:
        """Unlimited: nothing is held."""
        self._write(None)

    def _write(self, budget) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(dict(budget=budget)))
        os.replace(tmp, self.path)


def make_key(db_url: str, tenant: str = "default", tiers: tuple[str, ...] = ("priority",)) -> str:
    """A new key of `tenant` (made if new, granted `tiers`) in the database at `db_url`."""

    async def make() -> str:
        db = connect(db_url, pool_size=1)
        try:
            async with db.begin() as conn:
                await tenant_store.ensure_tenant(conn, tenant)
                await tenant_store.set_tiers(conn, tenant, tiers)
                return (await tenant_store.create_key(conn, tenant, "e2e"))[1]
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:  # its own event loop, whoever calls
        return pool.submit(asyncio.run, make()).result()


def make_admin_key(db_url: str) -> str:
    """An admin key of no tenant, made in the database as `POST /admin/keys` makes one."""

    async def make() -> str:
        db = connect(db_url, pool_size=1)
        try:
            async with db.begin() as conn:
                return (await tenant_store.create_key(conn, None, "e2e-admin", True))[1]
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, make()).result()


class Stack:
    def __init__(self, root: Path, env: dict[str, str], key: str, db_urls: Mapping[str, str]):
        self.root = root
        self.env = env
        self.db_urls = db_urls  # each service's own role's URL, by service
        self.url = f"http://127.0.0.1:{env['BALLAST_API_PORT']}"
        self.key = key
        self.headers = {"Authorization": f"Bearer {key}"}
        self.engine_headers = {"Authorization": f"Bearer {env['BALLAST_ENGINE_TOKEN']}"}  # the engine worker's
        self.metrics_token = env["BALLAST_METRICS_TOKEN"]
        self.control_url = f"http://127.0.0.1:{env['BALLAST_CONTROL_PORT']}"
        self.gate = Gate(Path(env["BALLAST_ENGINE_GATE"]))
        self.children: dict[str, procs.Child] = {}
        self.engine_url = ""
        self._engines = 0

    def http(self, timeout: float = 60) -> httpx.Client:
        """A client of the stack's API, with its key."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0)

    def start(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> procs.Child:
        """`ballast *args`, logged in to the journal as its service's own role."""
        kind = args[0] if args[0] == "api" else args[1]
        own = dict(BALLAST_DATABASE_URL=self.db_urls[kind], BALLAST_SERVICE_DATABASE_URL=self.db_urls[kind])
        child = procs.spawn(name, [sys.executable, "-m", "ballast.cli", *args],
                            env=dict(self.env, **own, **(env or {})),
                            log_path=self.root / "logs" / f"{name}.log")
        self.children[name] = child
        return child

    def start_engine(self) -> procs.Child:
        """An engine worker (the stack's current one) on a port of its own: `engine_url`."""
        self._engines += 1
        port = self.env.get("BALLAST_ENGINE_PORT") or str(procs.free_port())
        self.engine_url = f"http://127.0.0.1:{port}"
        return self.start(f"engine-{self._engines}", "worker", "engine", env=dict(BALLAST_ENGINE_PORT=port))

    @property
    def engine(self) -> procs.Child:
        return self.children[f"engine-{self._engines}"]

    def stats(self) -> dict:
        """The current engine worker's live /stats: slots, each batch hold's tokens, the gate."""
        return httpx.get(self.engine_url + "/stats", headers=self.engine_headers, timeout=10).json()

    def wait_stats(self, until: Callable[[dict], bool], what: str, timeout: float = WAIT_S) -> dict:
        """Poll the engine's live /stats until `until(stats)`; the stats that satisfied it."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.engine_url, headers=self.engine_headers, timeout=10) as http:
            while not until(stats := http.get("/stats").json()):
                assert time.monotonic() < deadline, f"{what}: {stats}"
                time.sleep(0.02)
        return stats

    def wait_held(self, budgets: Mapping[str, int], timeout: float = WAIT_S) -> dict:
        """Until every item named holds exactly its budget at the gate (its generation is
        running, waiting there, its batch slot held)."""

        def holding(stats: dict) -> bool:
            at = {r["item"]: r["tokens"] for r in stats["gate"]["requests"] if r["held"]}
            return all(at.get(item) == n for item, n in budgets.items())

        return self.wait_stats(holding, "not every item held at its budget", timeout)

    def healthy(self) -> bool:
        """Serving, and with the tokenizer loaded (which it is a second after the engine
        first serves): tests see exact reservations and prefix placement from the start."""
        try:
            r = httpx.get(self.url + "/healthz", headers=self.headers, timeout=3)  # a key sees the tokenizer
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json()["tokenizer"] == "loaded"

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            for c in self.children.values():
                if c.name.startswith("engine") and c is not self.engine:
                    continue
                assert c.alive, f"{c.name} died:\n{c.log_tail(60)}"
            assert time.monotonic() < deadline, "stack not healthy: " + httpx.get(self.url + "/healthz",
                                                                                  headers=self.headers).text
            time.sleep(0.5)

    def stop(self) -> None:
        for c in reversed(list(self.children.values())):
            c.stop(20)


def start_stack(root: Path, db_url: str, temporal_address: str, tiny_model, tag: str, **settings: str) -> Stack:
    """Engine worker, control worker and API on `db_url` (its owner's URL, which only the
    test itself uses: the services get the services' role's alone), with task queues of
    their own; `settings` are BALLAST_* variables on top."""
    env = dict(
        os.environ,
        BALLAST_TEMPORAL_ADDRESS=temporal_address,
        BALLAST_DATA_DIR=str(root),
        BALLAST_MODEL=tiny_model.path,
        BALLAST_SERVED_MODEL_NAME=tiny_model.name,
        BALLAST_MAX_MODEL_LEN=str(tiny_model.max_model_len),
        BALLAST_TOOL_CALL_PARSER=tiny_model.tool_call_parser or "",
        BALLAST_KV_CACHE_GIB="0.5",
        BALLAST_API_PORT=str(procs.free_port()),
        BALLAST_MAX_UPLOAD_BYTES=str(UPLOAD_LIMIT),
        BALLAST_HEARTBEAT_TIMEOUT_S="3",
        BALLAST_BATCH_ITEMS_PER_RUN="16",  # every multi-page batch also crosses continue-as-new
        BALLAST_CONTROL_QUEUE=f"control-{tag}",
        BALLAST_ENGINE_QUEUE=f"engine-{tag}",
        BALLAST_INTERACTIVE_QUEUE=f"interactive-{tag}",
        BALLAST_BATCH_COOL_DOWN_S="0.5",
        BALLAST_BATCH_WINDOWS='["1m", "1h", "24h"]',  # a window short enough to refuse on this engine's pace
        # Requests no API reported are journaled from the engine's record this soon (not
        # sooner: a slow workflow's outcome must not be beaten to it on a busy machine).
        BALLAST_UNREPORTED_AFTER_S="15",
        BALLAST_ENGINE_GATE=str(root / "gate.json"),  # unlimited until a test holds
        BALLAST_ENGINE_TOKEN=secrets.token_urlsafe(32),  # the API's and the engine workers' shared secret
        BALLAST_METRICS_TOKEN=secrets.token_urlsafe(32),  # what every /metrics asks of Prometheus
        BALLAST_CONTROL_PORT=str(procs.free_port()),  # the control worker's probes and /metrics
        # No bound on the wait for a slot: tests hold vLLM still with requests queued for as
        # long as they look, whatever the machine's speed (the bound: tests/engine, bench overload).
        BALLAST_WAIT_BOUND_PRIORITY_S="0",
        BALLAST_WAIT_BOUND_DEFAULT_S="0",
        BALLAST_WAIT_BOUND_FLEX_S="0",
    )
    env.update(settings)
    env.pop("DATABASE_URL", None)
    s = Stack(root, env, make_key(db_url), {kind: role_url_for(db_url, kind) for kind in SERVICE_ROLES})
    try:
        s.start_engine()
        s.start("control", "worker", "control")
        s.start("api", "api")
        s.wait_healthy()
    except BaseException:
        s.stop()
        raise
    return s


def start_batch(api: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """One greedy completions line uploaded, and a batch of it created, through the API:
    (file id, batch id)."""
    line = dict(custom_id="c0", method="POST", url="/v1/completions",
                body=dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0))
    file_id = api.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line) + "\n")},
                       data={"purpose": "batch"}).json()["id"]
    batch_id = api.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/completions",
                                                 completion_window="24h")).json()["id"]
    return file_id, batch_id


@contextmanager
def own_stack(tmp_path_factory, pg_server_url: str, temporal_address: str, tiny_model, tag: str,
              **settings: str) -> Iterator[tuple[Stack, str]]:
    """A stack of its own, on a database of its own, for a module whose settings differ
    from the shared stack's: (stack, owner URL of its database). Dropped afterwards."""
    name = f"ballast_test_{tag}_{os.getpid()}"
    url = pg.create_database(pg_server_url, name)
    try:
        migrate(url)
        s = start_stack(tmp_path_factory.mktemp(tag), url, temporal_address, tiny_model, f"{tag}-{os.getpid()}",
                        **settings)
        try:
            yield s, url
        finally:
            s.stop()
    finally:
        pg.drop_database(pg_server_url, name)


@pytest.fixture(scope="session")
def stack(tmp_path_factory, db_url, temporal_address, tiny_model):
    s = start_stack(tmp_path_factory.mktemp("stack"), db_url, temporal_address, tiny_model, str(os.getpid()))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def gate(stack):
    """The shared stack's engine gate, released again after the test, whatever happened."""
    try:
        yield stack.gate
    finally:
        stack.gate.release()


@pytest.fixture
def client(stack):
    return stack.openai()


@contextmanager
def vllm_paused(stack: Stack) -> Iterator[Callable[[float], None]]:
    """vLLM's own processes (the engine worker's descendants) stopped: no request makes
    progress or ends, so what the engine worker decides is seen whatever the machine's
    speed; the engine worker itself keeps serving. Yields `nudge(seconds)`, which lets
    vLLM run that long and stops it again: a few steps at a time."""
    pids = descendants(stack.engine.proc.pid)[1:]
    assert pids, "vLLM's processes not found"

    def signal_all(sig: int) -> None:
        for pid in pids:
            os.kill(pid, sig)

    def nudge(seconds: float) -> None:
        signal_all(signal.SIGCONT)
        time.sleep(seconds)
        signal_all(signal.SIGSTOP)

    signal_all(signal.SIGSTOP)
    try:
        yield nudge
    finally:
        signal_all(signal.SIGCONT)


@pytest.fixture
def up_dir():
    """A data dir for a `ballast up` of the test's own."""
    d = Path(tempfile.mkdtemp(prefix="ballast-test-up-"))  # short: Postgres's socket path
    yield d
    shutil.rmtree(d, ignore_errors=True)
