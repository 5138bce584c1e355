"""Temporal search attributes on the real stack: `temporal workflow list --query` by tenant
answers exactly that tenant's workflows (its batch), by kind only that kind, and each
carries its model and tier; interactive requests are journaled by windows that hold many
tenants' requests, found by kind. The oracle is the temporal CLI's own view of the server."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import uuid

import httpx
import pytest

from ballast.temporal_server import temporal_cli
from protocol import keys
from tests.e2e.conftest import make_key, start_batch

pytestmark = pytest.mark.e2e


def _listed(address: str, query: str) -> list[dict]:
    done = subprocess.run([temporal_cli(), "workflow", "list", "--address", address, "--query", query, "-o", "json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout or "[]")


def _ids(rows: list[dict]) -> set[str]:
    return {r["execution"]["workflowId"] for r in rows}


def test_workflows_are_found_by_tenant_kind_and_model(stack, temporal_address, db_url, tiny_model):
    mine, theirs = (f"search-{x}-{uuid.uuid4().hex[:8]}" for x in ("a", "b"))
    a = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {make_key(db_url, mine)}"})
    b = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {make_key(db_url, theirs)}"})
    chat = dict(model=tiny_model.name, max_tokens=2, messages=[dict(role="user", content="hi")])
    first = a.post("/v1/chat/completions", json=chat)
    assert first.status_code == 200, first.text
    second = b.post("/v1/chat/completions", json=chat)
    assert second.status_code == 200, second.text
    _, batch_id = start_batch(a, tiny_model.name, "hello", 2)
    want = {keys.batch(batch_id)}

    deadline = time.monotonic() + 60  # visibility is eventually consistent
    while (found := _ids(_listed(temporal_address, f'BallastTenant="{mine}"'))) != want:
        assert time.monotonic() < deadline, (found, want)
        time.sleep(0.5)
    rows = _listed(temporal_address, f'BallastTenant="{mine}" AND BallastKind="batch" '
                                     f'AND BallastModel="{tiny_model.name}" AND BallastTier="batch"')
    assert _ids(rows) == want
    assert _ids(_listed(temporal_address, f'BallastTenant="{theirs}"')) == set()  # its chat alone: no workflow
    # Both chats' window workflows are found by kind, and hold them (the workflow's input).
    chats = {first.json()["id"], second.json()["id"]}
    while not chats <= (held := _window_requests(temporal_address, stack.env["BALLAST_INTERACTIVE_QUEUE"])):
        assert time.monotonic() < deadline, (chats, held)
        time.sleep(0.5)


def _window_requests(address: str, queue: str) -> set[str]:
    """The request ids in the inputs of this stack's windows, listed by kind."""
    held = set()
    for wid in _ids(_listed(address, f'BallastKind="interactive" AND WorkflowType="RequestWindow" '
                                     f'AND TaskQueue="{queue}"')):
        done = subprocess.run([temporal_cli(), "workflow", "show", "--address", address, "--workflow-id", wid,
                               "-o", "json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        for event in json.loads(done.stdout)["events"]:
            if event.get("eventType") == "EVENT_TYPE_WORKFLOW_EXECUTION_STARTED":
                for payload in event["workflowExecutionStartedEventAttributes"]["input"]["payloads"]:
                    if "data" in payload:  # as stored: json/plain, base64 in proto's JSON
                        payload = json.loads(base64.b64decode(payload["data"]))
                    held |= {r["request_id"] for r in payload["requests"]}
    return held
