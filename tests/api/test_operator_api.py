"""What an operator does over HTTP with an admin key, with no database credentials: the
engine workers (list, drain, undrain) and a tenant's regions; and what a tenant reads of
its own books: `/v1/usage/completions` (OpenAI's usage shape) and `/v1/limits`.

Every figure is checked against rows the test wrote itself and against SQL over the
journal's own audit views, never against the code under test.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from tests.api.conftest import Untouchable, assert_openai_error, build, new_key

HOUR = 3600


@pytest.fixture
async def tenant(settings, db):
    name = f"books-{uuid.uuid4().hex[:8]}"
    async with build(settings, db, Untouchable("temporal"), await new_key(db, name)) as client:
        client.tenant = name
        yield client


async def _announce(owner, engine_id: str, region: str, running: int) -> None:
    async with owner.begin() as conn:
        await conn.execute(text(
            "INSERT INTO engines (id, url, model, queue, stats) VALUES (:id, 'http://10.0.0.9:8000', 'tiny', 'q', "
            "CAST(:stats AS jsonb))"), dict(id=engine_id, stats=f'{{"region": "{region}", "running": {running}, '
                                                                  f'"waiting": 2, "kv_cache_usage": 0.25}}'))


async def _draining(owner, engine_id: str) -> bool:
    async with owner.connect() as conn:
        found = await conn.execute(text("SELECT draining FROM engines WHERE id = :id"), dict(id=engine_id))
        return found.scalar_one()


async def test_an_admin_lists_drains_and_undrains_engine_workers(admin, tenant, owner):
    engine_id = f"gpu-node.example-{uuid.uuid4().hex[:6]}-4242"  # host names have dots
    await _announce(owner, engine_id, "eu-west", running=3)
    try:
        listed = {e["id"]: e for e in (await admin.get("/admin/engines")).json()["data"]}
        e = listed[engine_id]
        assert (e["object"], e["model"], e["region"], e["state"], e["running"], e["waiting"], e["kv_cache_usage"]) == (
            "engine", "tiny", "eu-west", "serving", 3, 2, 0.25), e
        drained = await admin.post(f"/admin/engines/{engine_id}/drain")
        assert drained.status_code == 200 and drained.json()["state"] == "draining", drained.text
        assert await _draining(owner, engine_id)  # as the database holds it, which the engine reads
        undrained = await admin.post(f"/admin/engines/{engine_id}/undrain")
        assert undrained.json()["state"] == "serving" and not await _draining(owner, engine_id)
        for bad in ("nobody-1", "a b", "x" * 300):
            assert_openai_error(await admin.post(f"/admin/engines/{bad}/drain"), 404, "engine_id")
        for method, path in (("GET", "/admin/engines"), ("POST", f"/admin/engines/{engine_id}/drain")):
            assert_openai_error(await tenant.request(method, path), 403, code="admin_key_required")
        assert not await _draining(owner, engine_id)
    finally:
        async with owner.begin() as conn:
            await conn.execute(text("DELETE FROM engines WHERE id = :id"), dict(id=engine_id))


async def test_an_admin_fences_a_tenant_to_regions(admin, tenant, owner):
    t = tenant.tenant
    r = await admin.put(f"/admin/tenants/{t}/regions", json=dict(regions=["us-east", "eu-west", "eu-west"]))
    assert r.status_code == 200 and r.json()["regions"] == ["eu-west", "us-east"], r.text
    async with owner.connect() as conn:
        held = (await conn.execute(text("SELECT regions FROM tenants WHERE id = :t"), dict(t=t))).scalar_one()
    assert sorted(held) == ["eu-west", "us-east"]
    assert {x["id"]: x["regions"] for x in (await admin.get("/admin/tenants")).json()["data"]}[t] == held
    assert_openai_error(await admin.put(f"/admin/tenants/{t}/regions", json=dict(regions=[" "])), 400, "regions")
    assert_openai_error(await admin.put("/admin/tenants/nobody-x/regions", json=dict(regions=["a"])), 404)
    assert (await admin.put(f"/admin/tenants/{t}/regions", json=dict(regions=None))).json()["regions"] is None


async def _settle(owner, tenant: str, model: str, tier: str, at: datetime, inp: int, out: int) -> None:
    async with owner.begin() as conn:
        await conn.execute(text(
            "INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, idempotency_key, at) "
            "VALUES (:t, :m, :tier, :s, 'settle', :i, :o, :k, :at)"),
            dict(t=tenant, m=model, tier=tier, s=f"request:{uuid.uuid4().hex}", i=inp, o=out,
                 k=uuid.uuid4().hex, at=at))


async def test_usage_in_openais_buckets_equals_the_audit_views(tenant, admin, owner, other_api):
    t = tenant.tenant
    base = datetime(2026, 3, 1, 10, tzinfo=UTC)
    start = int(base.timestamp())
    rows = [("tiny", "default", 0, 10, 5), ("tiny", "default", 10, 7, 1), ("tiny", "batch", 20, 100, 50),
            ("big", "priority", HOUR + 5, 3, 4)]
    for model, tier, dt, i, o in rows:
        await _settle(owner, t, model, tier, datetime.fromtimestamp(start + dt, UTC), i, o)
    await _settle(owner, other_api.tenant, "tiny", "default", base, 1000, 1000)  # another tenant's: never seen

    page = (await tenant.get("/v1/usage/completions", params=dict(start_time=start + 17, end_time=start + 3 * HOUR,
                                                                  bucket_width="1h",
                                                                  group_by=["model", "service_tier"]))).json()
    assert page["object"] == "page" and not page["has_more"] and page["next_page"] is None
    assert [b["start_time"] for b in page["data"]] == [start, start + HOUR, start + 2 * HOUR]  # UTC hours
    got = {(b["start_time"], r["model"], r["service_tier"]): (r["num_model_requests"], r["input_tokens"],
                                                              r["output_tokens"])
           for b in page["data"] for r in b["results"]}
    # The audit view, read as its documentation says, is the oracle.
    async with owner.begin() as conn:
        await conn.execute(text("SET LOCAL timezone = 'UTC'"))
        view = {(int(h.timestamp()), m, tier): (int(n), int(i), int(o)) for h, m, tier, n, i, o in (await conn.execute(
            text("SELECT hour, model, tier, requests, input_tokens, output_tokens FROM usage_by_hour "
                 "WHERE tenant = :t"), dict(t=t))).all()}
    assert got == view == {(start, "tiny", "default"): (2, 17, 6), (start, "tiny", "batch"): (1, 100, 50),
                           (start + HOUR, "big", "priority"): (1, 3, 4)}

    # Paged a bucket at a time, ungrouped: the same totals, bucket by bucket.
    first = (await tenant.get("/v1/usage/completions", params=dict(start_time=start, end_time=start + 2 * HOUR,
                                                                   bucket_width="1h", limit=1))).json()
    assert first["has_more"] and first["next_page"] == str(start + HOUR)
    (r0,) = first["data"][0]["results"]
    assert (r0["num_model_requests"], r0["input_tokens"], r0["model"], r0["service_tier"]) == (3, 117, None, None)
    second = (await tenant.get("/v1/usage/completions", params=dict(
        start_time=start, end_time=start + 2 * HOUR, bucket_width="1h", limit=1, page=first["next_page"]))).json()
    assert not second["has_more"] and second["data"][0]["results"][0]["output_tokens"] == 4

    # An admin sees the tenant it names; a tenant may not name another.
    as_admin = (await admin.get("/v1/usage/completions", params=dict(start_time=start, end_time=start + HOUR,
                                                                     bucket_width="1d", tenant=t))).json()
    assert as_admin["data"][0]["results"][0]["num_model_requests"] == 3
    assert_openai_error(await tenant.get("/v1/usage/completions", params=dict(start_time=start,
                                                                            tenant=other_api.tenant)), 403, "tenant")
    for bad in (dict(start_time=start, bucket_width="1w"), dict(start_time=start, bucket_width="1h", limit=169),
                dict(start_time=start, end_time=start - 1), dict(start_time=start, page="x"), dict(),
                dict(start_time=start, group_by="user_id")):
        r = await tenant.get("/v1/usage/completions", params=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)


async def test_limits_state_what_counts_against_them(tenant, admin, other_api):
    t = tenant.tenant
    assert (await tenant.get("/v1/limits")).json() == dict(object="list", data=[])  # none set: none listed
    r = await admin.put(f"/admin/tenants/{t}/limits", json=dict(model="*", tokens_per_day=5000, requests_per_min=60))
    assert r.status_code == 200, r.text
    mine = (await tenant.get("/v1/limits")).json()["data"]
    assert {(x["model"], x["limit"], x["allowed"]) for x in mine} == {("*", "tokens_per_day", 5000),
                                                                      ("*", "requests_per_min", 60)}
    assert all(x["tenant"] == t and x["used"] >= 0 for x in mine)
    assert (await other_api.get("/v1/limits")).json()["data"] == []  # its own only
    assert {x["tenant"] for x in (await admin.get("/v1/limits", params=dict(tenant=t))).json()["data"]} == {t}
