"""Temporal search attributes on the real stack: `temporal workflow list --query` by tenant
answers exactly that tenant's workflows (its batch, its chat), by kind only that kind, and
each carries its model and tier; the oracle is the temporal CLI's own view of the server."""

from __future__ import annotations

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
    assert b.post("/v1/chat/completions", json=chat).status_code == 200
    _, batch_id = start_batch(a, tiny_model.name, "hello", 2)
    want = {keys.batch(batch_id), keys.request(first.json()["id"])}

    deadline = time.monotonic() + 60  # visibility is eventually consistent
    while (found := _ids(_listed(temporal_address, f'BallastTenant="{mine}"'))) != want:
        assert time.monotonic() < deadline, (found, want)
        time.sleep(0.5)
    assert _ids(_listed(temporal_address, f'BallastTenant="{mine}" AND BallastKind="batch"')) == {keys.batch(batch_id)}
    rows = _listed(temporal_address, f'BallastTenant="{mine}" AND BallastKind="interactive" '
                                     f'AND BallastModel="{tiny_model.name}" AND BallastTier="default"')
    assert _ids(rows) == {keys.request(first.json()["id"])}
    assert len(_ids(_listed(temporal_address, f'BallastTenant="{theirs}"'))) == 1
