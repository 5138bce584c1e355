"""The OWASP API Security Top 10 (2023) checks that need no engine, over every route the
app has, so a route added later is covered or this fails:

- API1, broken object-level authorization: every /v1 route that takes an id, called by
  tenant B with tenant A's id, answers exactly as for an id that does not exist (404, the
  same message), and A's object is as it was;
- API5, broken function-level authorization: every /admin route refuses a tenant's key
  (403) and no key (401), before it reads anything;
- API3, object property level: a body naming another tenant (or any field the API does
  not take) cannot make an object someone else's.

Two fresh tenants per test, their objects journaled directly (B's client reaches neither
Temporal nor an engine, and must not need to).
"""

from __future__ import annotations

import io
import json
import re
import time
import uuid

import pytest
from fastapi.routing import APIRoute

from journal import batch_store, finetune_store
from tests.api.conftest import Untouchable, assert_openai_error, build, tenant_api

LINE = dict(custom_id="c0", method="POST", url="/v1/completions", body=dict(model="ballast-tiny", prompt="hi"))


@pytest.fixture
async def a(settings, db):
    async with tenant_api(settings, db, "a") as client:
        yield client


@pytest.fixture
async def objects(a, db) -> dict[str, str]:
    """A's file, batch and succeeded fine-tuning job (with its model): path parameter → A's value."""
    r = await a.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(json.dumps(LINE).encode() + b"\n"))},
                     data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    file_id, batch_id, job_id = r.json()["id"], "batch_" + uuid.uuid4().hex[:24], "ftjob-" + uuid.uuid4().hex[:24]
    model = f"ft:ballast-tiny:a:{job_id}"
    now = int(time.time())
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=batch_id, tenant=a.tenant, endpoint="/v1/completions",
                                                  input_file_id=file_id, completion_window="24h", metadata=None,
                                                  status="validating", created_at=now, expires_at=now + 86400))
        await finetune_store.create_job(conn, dict(
            id=job_id, tenant=a.tenant, model="ballast-tiny", training_file=file_id, validation_file=None,
            hyperparameters=dict(n_epochs=1, batch_size=1, learning_rate_multiplier=1.0), seed=1, suffix="a",
            metadata=None, status="succeeded", error=None, fine_tuned_model=model, trained_tokens=1, result_files=[],
            created_at=now, finished_at=now))
    hook = await a.post("/v1/webhooks", json=dict(url="https://example.com/a"))
    assert hook.status_code == 200, hook.text
    return dict(file_id=file_id, batch_id=batch_id, fine_tuning_job_id=job_id, model=model,
                webhook_id=hook.json()["id"])


# An id of each kind that exists nowhere, in the shape a real one has.
UNKNOWN = dict(file_id="file-" + "0" * 24, batch_id="batch_" + "0" * 24, fine_tuning_job_id="ftjob-" + "0" * 24,
               model="ft:ballast-tiny:a:ftjob-" + "0" * 24, webhook_id="wh_" + "0" * 24)


def id_routes(app) -> list[tuple[str, str]]:
    """(method, path template) of every /v1 route that takes an id."""
    return sorted((m, r.path) for r in app.routes if isinstance(r, APIRoute) and r.path.startswith("/v1/")
                  and "{" in r.path for m in r.methods)


def fill(template: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)(?::path)?\}", lambda m: values[m[1]], template)


async def test_every_route_that_takes_an_id_answers_another_tenants_id_as_unknown(a, other_api, objects):
    b = other_api
    routes = id_routes(b._transport.app)
    assert len(routes) >= 12, routes  # files, batches, fine-tuning jobs, models: all of them, not none
    before = (await a.get(f"/v1/files/{objects['file_id']}")).json()
    for method, template in routes:
        theirs = await b.request(method, fill(template, objects))
        unknown = await b.request(method, fill(template, UNKNOWN))
        param = re.search(r"\{(\w+)", template)[1]
        mine = assert_openai_error(theirs, 404, param)
        ref = assert_openai_error(unknown, 404, param)
        # Nothing tells them apart: the message differs only by the id it quotes.
        assert mine["message"].replace(objects[param], "ID") == ref["message"].replace(UNKNOWN[param], "ID"), \
            (method, template, mine, ref)
    # A's objects are as they were: nothing B sent (a DELETE, a cancel) reached them.
    assert (await a.get(f"/v1/files/{objects['file_id']}")).json() == before
    assert (await a.get(f"/v1/batches/{objects['batch_id']}")).json()["status"] == "validating"
    assert (await a.get(f"/v1/fine_tuning/jobs/{objects['fine_tuning_job_id']}")).json()["status"] == "succeeded"
    assert objects["model"] in [m["id"] for m in (await a.get("/v1/models")).json()["data"]]
    assert (await a.get(f"/v1/webhooks/{objects['webhook_id']}")).status_code == 200


async def test_every_admin_route_refuses_a_tenants_key_and_no_key(a, settings):
    app = a._transport.app
    routes = sorted((m, r.path) for r in app.routes if isinstance(r, APIRoute) and r.path.startswith("/admin/")
                    for m in r.methods)
    assert len(routes) >= 6, routes
    values = dict(tenant_id="default", key_id="key_" + "0" * 24, engine_id="nobody-1")
    async with build(settings, Untouchable("postgres"), Untouchable("temporal")) as anonymous:
        for method, template in routes:
            path = fill(template, values)
            r = await a.request(method, path, json={})
            err = assert_openai_error(r, 403, code="admin_key_required")
            assert err["type"] == "permission_error", (method, path)
            assert_openai_error(await anonymous.request(method, path, json={}), 401)


async def test_a_body_cannot_make_an_object_another_tenants(a, other_api, objects, db):
    b = other_api
    r = await b.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(json.dumps(LINE).encode() + b"\n"))},
                     data={"purpose": "batch", "tenant": a.tenant, "organization_id": a.tenant})
    assert r.status_code == 200, r.text
    async with db.connect() as conn:
        row = await batch_store.get_file(conn, r.json()["id"], b.tenant)
    assert row is not None and row["tenant"] == b.tenant
    # A batch from B naming A as its tenant, on A's file: A's file is not B's to use.
    r = await b.post("/v1/batches", json=dict(input_file_id=objects["file_id"], endpoint="/v1/completions",
                                               completion_window="24h", tenant=a.tenant))
    assert_openai_error(r, 404, "input_file_id", "not_found")
