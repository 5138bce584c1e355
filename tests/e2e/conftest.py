"""The real stack as processes: engine worker (vLLM), control worker and API, on the test's
Postgres database and Temporal dev server. Shared by every end-to-end test."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from ballast import procs

UPLOAD_LIMIT = 256 * 1024


class Stack:
    def __init__(self, root: Path, env: dict[str, str]):
        self.root = root
        self.env = env
        self.url = f"http://127.0.0.1:{env['BALLAST_API_PORT']}"
        self.children: dict[str, procs.Child] = {}
        self._engines = 0

    def start(self, name: str, *args: str) -> procs.Child:
        child = procs.spawn(name, [sys.executable, "-m", "ballast.cli", *args], env=self.env,
                            log_path=self.root / "logs" / f"{name}.log")
        self.children[name] = child
        return child

    def start_engine(self) -> procs.Child:
        self._engines += 1
        return self.start(f"engine-{self._engines}", "worker", "engine")

    @property
    def engine(self) -> procs.Child:
        return self.children[f"engine-{self._engines}"]

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            for c in self.children.values():
                if c.name.startswith("engine") and c is not self.engine:
                    continue
                assert c.alive, f"{c.name} died:\n{c.log_tail(60)}"
            assert time.monotonic() < deadline, "stack not healthy: " + httpx.get(self.url + "/healthz").text
            time.sleep(0.5)

    def stop(self) -> None:
        for c in reversed(list(self.children.values())):
            c.stop(20)


def start_stack(root: Path, db_url: str, temporal_address: str, tiny_model, tag: str, **settings: str) -> Stack:
    """Engine worker, control worker and API on `db_url`, with task queues of their own;
    `settings` are BALLAST_* variables on top."""
    env = dict(
        os.environ,
        BALLAST_DATABASE_URL=db_url,
        BALLAST_TEMPORAL_ADDRESS=temporal_address,
        BALLAST_DATA_DIR=str(root),
        BALLAST_MODEL=tiny_model.path,
        BALLAST_SERVED_MODEL_NAME=tiny_model.name,
        BALLAST_MAX_MODEL_LEN=str(tiny_model.max_model_len),
        BALLAST_KV_CACHE_GIB="0.5",
        BALLAST_API_PORT=str(procs.free_port()),
        BALLAST_MAX_UPLOAD_BYTES=str(UPLOAD_LIMIT),
        BALLAST_HEARTBEAT_TIMEOUT_S="3",
        BALLAST_BATCH_ITEMS_PER_RUN="16",  # every multi-page batch also crosses continue-as-new
        BALLAST_CONTROL_QUEUE=f"control-{tag}",
        BALLAST_ENGINE_QUEUE=f"engine-{tag}",
        BALLAST_INTERACTIVE_QUEUE=f"interactive-{tag}",
        BALLAST_BATCH_COOL_DOWN_S="0.5",
    )
    env.update(settings)
    env.pop("DATABASE_URL", None)
    s = Stack(root, env)
    try:
        s.start_engine()
        s.start("control", "worker", "control")
        s.start("api", "api")
        s.wait_healthy()
    except BaseException:
        s.stop()
        raise
    return s


@pytest.fixture(scope="session")
def stack(tmp_path_factory, db_url, temporal_address, tiny_model):
    s = start_stack(tmp_path_factory.mktemp("stack"), db_url, temporal_address, tiny_model, str(os.getpid()))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key="test-key", max_retries=0)
