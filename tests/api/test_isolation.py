"""Tenants see only their own: another tenant's file, file content, batch (retrieve,
cancel, a batch made from its file) is a 404 exactly like an id that does not exist, and
lists hold only the caller's own. Two fresh tenants, A and B; A creates through real
Temporal (a control queue no worker polls, so A's batch stays `validating`); B must be
turned away before Temporal, which its client cannot reach."""

from __future__ import annotations

import io
import json
import uuid

import pytest

from journal import batch_store
from tests.api.conftest import assert_openai_error, build, new_key

LINE = dict(custom_id="c0", method="POST", url="/v1/completions", body=dict(model="ballast-tiny", prompt="hi"))


@pytest.fixture
async def a(settings, db, temporal_client):
    async with build(settings, db, temporal_client, await new_key(db, "a-" + uuid.uuid4().hex[:8])) as client:
        yield client


@pytest.fixture
def b(other_api):
    return other_api


async def upload(client) -> str:
    r = await client.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(json.dumps(LINE).encode() + b"\n"))},
                          data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


async def batch(client, file_id: str) -> str:
    r = await client.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/completions",
                                                   completion_window="24h"))
    assert r.status_code == 200, r.text
    return r.json()["id"]


def same_404(theirs, unknown, param: str) -> None:
    """Another tenant's id answers as an id that does not exist: nothing tells them apart."""
    mine = assert_openai_error(theirs, 404, param, "not_found")
    ref = assert_openai_error(unknown, 404, param, "not_found")
    assert mine["message"].split("'")[0] == ref["message"].split("'")[0]


async def test_another_tenants_file_and_its_content_are_404(a, b):
    fid = await upload(a)
    missing = "file-" + uuid.uuid4().hex[:24]
    same_404(await b.get(f"/v1/files/{fid}"), await b.get(f"/v1/files/{missing}"), "file_id")
    same_404(await b.get(f"/v1/files/{fid}/content"), await b.get(f"/v1/files/{missing}/content"), "file_id")
    assert (await a.get(f"/v1/files/{fid}")).status_code == 200
    got = await a.get(f"/v1/files/{fid}/content")
    assert got.json() == LINE
    # Never rendered as a page of the API's origin, whatever it holds.
    assert got.headers["x-content-type-options"] == "nosniff" and got.headers["content-disposition"] == "attachment"
    # And the other way round.
    theirs = await upload(b)
    assert_openai_error(await a.get(f"/v1/files/{theirs}"), 404, "file_id", "not_found")


async def test_another_tenants_batch_cannot_be_read_or_cancelled(a, b):
    bid = await batch(a, await upload(a))
    missing = "batch_" + uuid.uuid4().hex[:24]
    same_404(await b.get(f"/v1/batches/{bid}"), await b.get(f"/v1/batches/{missing}"), "batch_id")
    same_404(await b.post(f"/v1/batches/{bid}/cancel"), await b.post(f"/v1/batches/{missing}/cancel"), "batch_id")
    mine = (await a.get(f"/v1/batches/{bid}")).json()
    assert mine["status"] == "validating" and mine["cancelling_at"] is None  # B's cancel did nothing


async def test_a_batch_from_another_tenants_file_is_404(a, b):
    fid = await upload(a)
    r = await b.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/completions", completion_window="24h"))
    assert_openai_error(r, 404, "input_file_id", "not_found")
    assert (await b.get("/v1/batches")).json()["data"] == []  # nothing was made


async def test_lists_hold_only_the_callers_own(a, b, db):
    # B's one batch, older than A's (journaled directly: B's client cannot reach Temporal).
    own = "batch_" + uuid.uuid4().hex[:24]
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=own, tenant=b.tenant, endpoint="/v1/completions",
                                                  input_file_id="file-x",
                                                  completion_window="24h", metadata=None, status="validating",
                                                  created_at=0, expires_at=1))
    ids = [await batch(a, await upload(a)) for _ in range(2)]
    listed = (await a.get("/v1/batches")).json()
    assert [x["id"] for x in listed["data"]] == ids[::-1] and not listed["has_more"]
    listed = (await b.get("/v1/batches")).json()
    assert [x["id"] for x in listed["data"]] == [own] and (listed["first_id"], listed["last_id"]) == (own, own)
    # A's id as B's cursor pages like an unknown one: it says nothing about A's batches.
    assert (await b.get("/v1/batches", params=dict(after=ids[1]))).json()["data"] == []
    assert [x["id"] for x in (await a.get("/v1/batches", params=dict(after=ids[1]))).json()["data"]] == ids[:1]
