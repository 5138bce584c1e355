"""Ballast reaches a Temporal that takes only TLS with a client certificate (mTLS), configured
through the SDK's TEMPORAL_* variables or a TOML profile alone, as a secured cluster or
Temporal Cloud is.

The secured Temporal is the test's dev server behind HAProxy from the OS packages (`make
install` installs it), terminating TLS and demanding a certificate of the test's throwaway
CA, as a production terminator would. Not stunnel: gRPC clients insist on ALPN "h2", which
stunnel cannot negotiate (the SDK fails with H2NotNegotiated), and HAProxy can.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import Worker

from ballast import procs
from bench.tls import Pki, haproxy, haproxy_conf, make_pki
from config.temporal import TemporalSettings, connect_temporal
from workflows.fleet import FLEET_ID
from workflows.quota import QUOTA_ID

HANG_GUARD_S = 60  # a refusal comes at once; only a hang would take this long


@workflow.defn(sandboxed=False)
class Echo:
    @workflow.run
    async def run(self, text: str) -> str:
        return text


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_address(temporal_address, pki, tmp_path_factory) -> Iterator[str]:
    """HAProxy on a port of its own in front of the dev server (bench/tls.py)."""
    try:
        binary = haproxy()
    except FileNotFoundError as err:
        pytest.fail(str(err))
    root = tmp_path_factory.mktemp("haproxy")
    port = procs.free_port()
    config = haproxy_conf(pki, root, accept=f"127.0.0.1:{port}", connect=temporal_address)
    child = procs.spawn("haproxy", [binary, "-db", "-f", str(config)], log_path=root / "haproxy.log")
    try:
        procs.wait_until(lambda: procs.port_open(port), 30, f"HAProxy on 127.0.0.1:{port}", child=child)
        yield f"127.0.0.1:{port}"
    finally:
        child.stop()


def tls_env(pki: Pki, address: str) -> dict[str, str]:
    return dict(
        TEMPORAL_ADDRESS=address,
        TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(pki.ca_cert),
        TEMPORAL_TLS_CLIENT_CERT_PATH=str(pki.client_cert),
        TEMPORAL_TLS_CLIENT_KEY_PATH=str(pki.client_key),
    )


@pytest.fixture
def environ(monkeypatch, tmp_path):
    """Sets the process's environment to exactly the given Temporal variables (no others,
    no ~/.config/temporalio/temporal.toml)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))

    def set_only(env: dict[str, str]) -> None:
        for name in list(os.environ):
            if name.startswith(("TEMPORAL_", "BALLAST_TEMPORAL_")):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_only


async def connect() -> Client:
    return await asyncio.wait_for(connect_temporal(TemporalSettings(_env_file=None)), HANG_GUARD_S)


async def test_mtls_through_the_temporal_variables(environ, pki, tls_address):
    environ(tls_env(pki, tls_address))
    client = await connect()
    assert (await client.workflow_service.get_system_info(GetSystemInfoRequest())).server_version
    queue = f"tls-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[Echo]):
        result = await client.execute_workflow(Echo.run, "over mTLS", id=f"echo-{queue}", task_queue=queue,
                                               execution_timeout=timedelta(seconds=HANG_GUARD_S))
    assert result == "over mTLS"


async def test_mtls_through_a_toml_profile(environ, pki, tls_address, tmp_path):
    profiles = tmp_path / "temporal.toml"
    profiles.write_text(f"""
[profile.secured]
address = "{tls_address}"
namespace = "default"

[profile.secured.tls]
server_name = "localhost"
server_ca_cert_path = "{pki.ca_cert}"
client_cert_path = "{pki.client_cert}"
client_key_path = "{pki.client_key}"
""")
    environ(dict(TEMPORAL_CONFIG_FILE=str(profiles), TEMPORAL_PROFILE="secured"))
    client = await connect()
    assert (await client.workflow_service.get_system_info(GetSystemInfoRequest())).server_version


CA, CERT, KEY = "TEMPORAL_TLS_SERVER_CA_CERT_PATH", "TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_KEY_PATH"


@pytest.mark.parametrize("drop, tls, refusal", [
    # The server's certificate is checked against the system's roots, which do not know the test's CA.
    ([CA], None, "UnknownIssuer"),
    # HAProxy demands a client certificate. TLS 1.3 finishes the client's side of the handshake
    # first, so the first call fails: on HAProxy's alert or the closed connection, whichever it sees.
    ([CERT, KEY], None, "call error after connection"),
    # Plain-text HTTP/2 to the TLS port: HAProxy drops it.
    ([CA, CERT, KEY], "false", "Failed client connect"),
], ids=["without-the-ca", "without-a-client-certificate", "plain-text"])  # fmt: skip
async def test_refused_without_what_the_server_demands(environ, pki, tls_address, drop, tls, refusal):
    env = {k: v for k, v in tls_env(pki, tls_address).items() if k not in drop}
    if tls is not None:
        env["TEMPORAL_TLS"] = tls
    environ(env)
    with pytest.raises(RuntimeError, match=refusal):
        await connect()


async def test_a_ballast_control_worker_through_the_terminator(environ, pki, tls_address, service_db_url, tmp_path):
    """The real process, told where Temporal is by TEMPORAL_* alone: the CLI counts the address
    as configured, the worker starts the fleet controller and the quota reconciler, and runs them."""
    environ(tls_env(pki, tls_address))
    tag = uuid.uuid4().hex[:8]
    ready = tmp_path / "ready"
    env = dict(
        os.environ,  # the TEMPORAL_* variables above, and no BALLAST_TEMPORAL_*
        BALLAST_DATABASE_URL=service_db_url,
        BALLAST_SERVICE_DATABASE_URL=service_db_url,
        BALLAST_DATA_DIR=str(tmp_path / "data"),
        BALLAST_CONTROL_QUEUE=f"control-{tag}",
        BALLAST_INTERACTIVE_QUEUE=f"interactive-{tag}",
        BALLAST_READY_FILE=str(ready),
    )
    env.pop("DATABASE_URL", None)
    child = procs.spawn("control worker", [sys.executable, "-m", "ballast.cli", "worker", "control"], env=env,
                        log_path=tmp_path / "control.log")
    client = await connect()
    try:
        await asyncio.to_thread(procs.wait_until, lambda: procs.said_ready(ready, child.pid), 120,
                                "the control worker to start its workflows", child=child)
        fleet = client.get_workflow_handle(f"{FLEET_ID}:control-{tag}")
        assert (await fleet.describe()).status == WorkflowExecutionStatus.RUNNING

        async def ran_a_task() -> bool:  # the worker polled, ran and answered through HAProxy
            history = await fleet.fetch_history()
            return any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED for e in history.events)

        for _ in range(HANG_GUARD_S * 4):
            if await ran_a_task():
                break
            assert child.alive, child.log_tail()
            await asyncio.sleep(0.25)
        else:
            pytest.fail(f"the fleet controller never ran:\n{child.log_tail()}")
    finally:
        child.stop()
        for workflow_id in (f"{FLEET_ID}:control-{tag}", f"{QUOTA_ID}:control-{tag}"):
            try:
                await client.get_workflow_handle(workflow_id).terminate("test over")
            except Exception:
                pass  # never started
