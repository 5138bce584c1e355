"""API keys: every /v1 and /admin route needs one, answered as OpenAI answers without one
or with a bad one (checked with the official client too); a revoked key stops working
within BALLAST_KEY_CACHE_S; /admin needs an admin key, and what it makes works."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid

import httpx
import openai
import pytest
from sqlalchemy import text

from api.services.auth import NO_KEY, KeyCache
from journal import tenant_store
from journal.tenant_store import Principal
from protocol.limits import LIMITS
from tests.api.conftest import Untouchable, assert_openai_error, build, new_key
from tests.helpers import Clock

# One of each kind of route; a valid body where there is one, so only the key is wrong.
CHAT = dict(model="ballast-tiny", messages=[dict(role="user", content="hi")], max_tokens=2)
ROUTES = [
    ("GET", "/v1/models", None), ("GET", "/v1/models/ballast-tiny", None), ("GET", "/v1/batches", None),
    ("GET", "/v1/batches/batch_abc", None), ("POST", "/v1/batches/batch_abc/cancel", None),
    ("POST", "/v1/batches", dict(input_file_id="file-abc", endpoint="/v1/chat/completions", completion_window="24h")),
    ("GET", "/v1/files/file-abc", None), ("GET", "/v1/files/file-abc/content", None),
    ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", dict(model="ballast-tiny", prompt="hi")),
    ("GET", "/admin/tenants", None), ("POST", "/admin/tenants", dict(id="nobody")),
    ("POST", "/admin/keys/key_abc/revoke", None), ("GET", "/admin/tenants/default/limits", None),
]


@pytest.fixture
async def anonymous(settings):
    """No key; neither Postgres nor Temporal may be reached."""
    async with build(settings, Untouchable("postgres"), Untouchable("temporal")) as client:
        yield client


@pytest.fixture
def client_with(settings, db):
    """`client_with(key)`: a client of the app on the test database, sending `key`."""
    return lambda key: build(settings, db, Untouchable("temporal"), key)


def refused(r: httpx.Response, code: str | None) -> dict:
    err = assert_openai_error(r, 401, code=code)
    assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] == code
    assert r.headers["www-authenticate"] == "Bearer"
    return err


@pytest.mark.parametrize("method, path, body", ROUTES)
async def test_no_key_is_401_as_openai_says_it_before_anything_is_reached(anonymous, method, path, body):
    err = refused(await anonymous.request(method, path, json=body), None)
    assert err["message"] == NO_KEY


@pytest.mark.parametrize("header", ["", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "sk-ballast-no-scheme"])
async def test_a_header_without_a_bearer_key_is_no_key(anonymous, header):
    assert refused(await anonymous.get("/v1/models", headers={"Authorization": header}), None)["message"] == NO_KEY


async def test_an_upload_without_a_key_is_refused_before_its_body_is_read(anonymous, settings):
    read = []

    async def body():
        read.append(1)
        yield b"--x\r\n"

    r = await anonymous.post("/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=x"})
    refused(r, None)
    assert not read and not [f for f in (settings.data_dir / "objects").rglob("*") if f.is_file()]


async def test_a_bad_key_is_401_invalid_api_key_showing_only_its_ends(client_with):
    bad = "sk-ballast-" + "x" * 39 + "wxyz"
    async with client_with(bad) as client:
        err = refused(await client.get("/v1/batches"), "invalid_api_key")
    assert err["message"].startswith("Incorrect API key provided: sk-balla***wxyz.")
    assert bad not in err["message"] and "x" * 8 not in err["message"]
    async with client_with("short") as client:
        err = refused(await client.get("/v1/models"), "invalid_api_key")
    assert "short" not in err["message"]


async def test_open_routes_need_no_key(api, anonymous, settings):
    for path in ("/openapi.json", "/docs", "/redoc"):  # off unless enabled: they map the admin API too
        assert (await anonymous.get(path)).status_code == 404
    async with build(settings.model_copy(update=dict(api_docs=True)), Untouchable("postgres"),
                     Untouchable("temporal")) as documented:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert (await documented.get(path)).status_code == 200, path
    r = await api.get("/healthz", headers={"Authorization": ""})  # Temporal is untouchable: 503, but not 401
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}  # and no more, to anyone
    r = await api.get("/healthz", headers={"Authorization": "Bearer sk-ballast-" + "x" * 43})  # nor a bad key
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}
    r = await api.get("/healthz")  # a tenant's key: each part's state, not why
    assert r.status_code == 503 and r.json()["parts"]["postgres"] == "ok", r.text
    assert r.json()["parts"]["temporal_control_worker"] == "down", r.text


async def test_the_openai_client_sees_an_authentication_error(settings, db):
    http = build(settings, db, Untouchable("temporal"))
    transport = http._transport
    good = await new_key(db, "default")
    async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key="sk-ballast-not-a-real-key-at-all",
                                  max_retries=0, http_client=httpx.AsyncClient(transport=transport)) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.models.list()
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=good, max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport)) as client:
        assert [m.id for m in (await client.models.list()).data][0] == "ballast-tiny"


async def test_a_key_revoked_elsewhere_stops_within_key_cache_s(settings, db):
    settings = settings.model_copy(update=dict(key_cache_s=1.0))
    key = await new_key(db, "default")
    async with build(settings, db, Untouchable("temporal"), key) as client:
        assert (await client.get("/v1/batches")).status_code == 200
        async with db.begin() as conn:  # as another API process or the CLI would: this one's cache is not told
            await conn.execute(text("UPDATE api_keys SET revoked_at = now() WHERE hash = :h"),
                               dict(h=hashlib.sha256(key.encode()).hexdigest()))
        revoked_at = time.monotonic()
        while (r := await client.get("/v1/batches")).status_code == 200:
            await asyncio.sleep(0.05)
        waited = time.monotonic() - revoked_at
        refused(r, "invalid_api_key")
        assert waited <= 1.0 + 0.5, waited  # the bound, and slack for a busy machine


async def test_a_tenant_key_is_403_on_admin_routes(api):
    for method, path, body in ROUTES:
        if path.startswith("/admin"):
            err = assert_openai_error(await api.request(method, path, json=body), 403, code="admin_key_required")
            assert err["type"] == "permission_error" and err["message"] == "This endpoint needs an admin key."


async def test_an_admin_key_belongs_to_no_tenant_and_has_no_v1(admin, client_with):
    """An admin administers: it never doubles as a tenant's key, and a tenant's keys are
    never admin keys."""
    for method, path, body in ROUTES:
        if path.startswith("/v1"):
            assert_openai_error(await admin.request(method, path, json=body), 403, code="tenant_key_required")
    assert_openai_error(await admin.post("/admin/tenants/default/keys", json=dict(admin=True)), 400, "admin")
    made = (await admin.post("/admin/keys", json=dict(name="ops"))).json()
    assert made["admin"] and made["tenant"] is None and made["key"].startswith(made["prefix"])
    assert made["id"] in [k["id"] for k in (await admin.get("/admin/keys")).json()["data"]]
    async with client_with(made["key"]) as ops:
        assert (await ops.get("/admin/tenants")).status_code == 200
        assert_openai_error(await ops.get("/v1/models"), 403, code="tenant_key_required")


async def test_the_admin_flow(admin, client_with, db):
    tenant = "acme-" + uuid.uuid4().hex[:8]
    r = await admin.post("/admin/tenants", json=dict(id=tenant, weight=3))
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["tenant"]["id"] == tenant and made["tenant"]["weight"] == 3 and made["tenant"]["tiers"] == []
    first = made["key"]
    assert first["key"].startswith(first["prefix"]) and first["tenant"] == tenant and not first["admin"]

    # Bounded from the start, in every dimension (BALLAST_NEW_TENANT_LIMITS).
    [start] = (await admin.get(f"/admin/tenants/{tenant}/limits")).json()["data"]
    assert start["model"] == "*" and all(start[d] is not None for d in LIMITS), start

    async with client_with(first["key"]) as acme:
        r = await acme.get("/v1/batches")
        assert r.status_code == 200 and r.json()["data"] == []  # a tenant of its own: nothing yet
        assert_openai_error(await acme.get("/admin/tenants"), 403)

    assert tenant in [t["id"] for t in (await admin.get("/admin/tenants")).json()["data"]]
    second = (await admin.post(f"/admin/tenants/{tenant}/keys", json=dict(name="ci"))).json()
    assert second["name"] == "ci" and second["key"] != first["key"]
    listed = (await admin.get(f"/admin/tenants/{tenant}/keys")).json()["data"]
    assert [k["id"] for k in listed] == [first["id"], second["id"]]
    for k in listed:
        assert "key" not in k and "hash" not in k and k["revoked_at"] is None

    r = await admin.post(f"/admin/keys/{first['id']}/revoke")
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    # Revoked on this process: at once, whatever the cache's bound.
    async with client_with(first["key"]) as old, client_with(second["key"]) as new:
        refused(await old.get("/v1/models"), "invalid_api_key")
        assert (await new.get("/v1/models")).status_code == 200

    # Tiers are granted (replaced whole), and the key carries them once its cache entry is asked again.
    r = await admin.put(f"/admin/tenants/{tenant}/tiers", json=dict(tiers=["priority"]))
    assert r.status_code == 200 and r.json()["tiers"] == ["priority"], r.text
    listed_tiers = {t["id"]: t["tiers"] for t in (await admin.get("/admin/tenants")).json()["data"]}
    assert listed_tiers[tenant] == ["priority"]
    async with db.connect() as conn:
        principal = await tenant_store.lookup(conn, second["key"])
    assert principal is not None and principal.tiers == {"priority"}
    assert (await admin.put(f"/admin/tenants/{tenant}/tiers", json=dict(tiers=[]))).json()["tiers"] == []

    r = await admin.put(f"/admin/tenants/{tenant}/limits", json=dict(requests_per_min=60, tokens_per_day=1000))
    assert r.status_code == 200 and r.json()["model"] == "*" and r.json()["requests_per_min"] == 60
    await admin.put(f"/admin/tenants/{tenant}/limits", json=dict(model="ballast-tiny", concurrent_requests=2))
    r = await admin.put(f"/admin/tenants/{tenant}/limits", json=dict(requests_per_min=30))  # replaced whole
    limits = (await admin.get(f"/admin/tenants/{tenant}/limits")).json()["data"]
    assert [(x["model"], x["requests_per_min"], x["tokens_per_day"], x["concurrent_requests"]) for x in limits] == [
        ("*", 30, None, None), ("ballast-tiny", None, None, 2)]


async def test_admin_mistakes(admin):
    assert_openai_error(await admin.post("/admin/tenants", json=dict(id="Bad Name")), 400, "id", "invalid_value")
    assert_openai_error(await admin.post("/admin/tenants", json=dict(id="x", weight=0)), 400, "weight")
    assert_openai_error(await admin.post("/admin/tenants", json=dict(id="default")), 409, "id", "tenant_exists")
    for method, path in [("GET", "/admin/tenants/nobody-here/keys"), ("POST", "/admin/tenants/nobody-here/keys"),
                         ("GET", "/admin/tenants/nobody-here/limits"), ("GET", "/admin/tenants/%00/keys")]:
        assert_openai_error(await admin.request(method, path), 404, "tenant_id", "not_found")
    assert_openai_error(await admin.put("/admin/tenants/nobody-here/limits", json={}), 404, "tenant_id")
    assert_openai_error(await admin.put("/admin/tenants/default/limits", json=dict(tokens_per_day=-1)), 400,
                        "tokens_per_day")
    assert_openai_error(await admin.post("/admin/keys/key_nope/revoke"), 404, "key_id", "not_found")
    assert_openai_error(await admin.put("/admin/tenants/default/tiers", json=dict(tiers=["flex"])), 400, "tiers")
    assert_openai_error(await admin.put("/admin/tenants/default/tiers", json=dict(tiers=["\x00"])), 400, "tiers")
    assert_openai_error(await admin.put("/admin/tenants/nobody-here/tiers", json=dict(tiers=[])), 404, "tenant_id")
    assert_openai_error(await admin.post("/admin/tenants", json=dict(id="tiered", tiers=["gold"])), 400, "tiers")
    assert_openai_error(await admin.post("/admin/keys/%00/revoke"), 404, "key_id", "not_found")


# -- the cache itself ------------------------------------------------------------------



def counting(known: dict[str, Principal], delay: float = 0.0):
    asked: list[str] = []

    async def lookup(key: str) -> Principal | None:
        asked.append(key)
        await asyncio.sleep(delay)
        return known.get(key)

    return lookup, asked


async def test_the_cache_asks_once_per_key_and_again_after_its_bound():
    clock = Clock()
    lookup, asked = counting({"good": Principal("t", "k")}, delay=0.01)
    cache = KeyCache(lookup, ttl_s=5, clock=clock)
    got = await asyncio.gather(*[cache.principal(k) for k in ["good"] * 20 + ["bad"] * 20])
    assert got == [Principal("t", "k")] * 20 + [None] * 20
    assert sorted(asked) == ["bad", "good"]  # concurrent misses share one lookup
    clock.now = 4.9
    await cache.principal("good"), await cache.principal("bad")
    assert len(asked) == 2
    clock.now = 5.0
    await cache.principal("good"), await cache.principal("bad")
    assert len(asked) == 4


async def test_a_known_key_due_again_is_answered_from_memory_while_one_query_refreshes_it():
    """Past the bound a known key's requests do not wait for the query that asks again
    (a slow database would stall every stream of the key at once) up to twice the bound;
    what the query finds (here: revoked) answers from then on; past twice the bound with
    no answer they wait for it."""
    clock = Clock()
    known = {"good": Principal("t", "k")}
    gate = asyncio.Event()
    asked: list[str] = []

    async def lookup(key: str) -> Principal | None:
        asked.append(key)
        if len(asked) > 1:
            await gate.wait()  # the database is slow to answer the second time
        return known.get(key)

    cache = KeyCache(lookup, ttl_s=5, clock=clock)
    assert await cache.principal("good") == Principal("t", "k")
    del known["good"]  # revoked elsewhere
    clock.now = 6.0
    got = await asyncio.wait_for(asyncio.gather(*[cache.principal("good") for _ in range(20)]), 1)
    assert got == [Principal("t", "k")] * 20
    await asyncio.sleep(0)
    assert asked == ["good", "good"]  # one query, however many asked meanwhile
    gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert await cache.principal("good") is None and len(asked) == 2  # its answer stands

    slow = KeyCache(lookup, ttl_s=5, clock=clock)
    known["good"] = Principal("t", "k")
    clock.now = 0.0
    await slow.principal("good")
    gate.clear()
    clock.now = 10.0  # twice the bound: not answered from memory any more
    waiting = asyncio.ensure_future(slow.principal("good"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    gate.set()
    assert await waiting == Principal("t", "k")


async def test_unknown_keys_are_bounded_and_a_failed_lookup_is_not_remembered():
    lookup, asked = counting({})
    cache = KeyCache(lookup, ttl_s=60, max_unknown=100)
    for i in range(1000):
        assert await cache.principal(f"random-{i}") is None
    assert len(cache._unknown) == 100 and len(asked) == 1000
    await cache.principal("random-999")
    assert len(asked) == 1000  # the most recent are remembered

    calls = 0

    async def down(key: str) -> Principal | None:
        nonlocal calls
        calls += 1
        raise OSError("postgres is away")

    failing = KeyCache(down, ttl_s=60)
    for _ in range(2):
        with pytest.raises(OSError):
            await failing.principal("k")
    assert calls == 2


async def test_a_key_that_cannot_be_checked_is_503_not_let_in(settings):
    async def down(key: str) -> Principal | None:
        raise OSError("postgres is away")

    client = build(settings, Untouchable("postgres"), Untouchable("temporal"), "sk-ballast-" + "w" * 43)
    client._transport.app.state.services.keys = KeyCache(down, 5)
    async with client:
        assert_openai_error(await client.get("/v1/models"), 503, code="unavailable")


async def test_a_value_no_key_can_have_never_reaches_the_database(settings):
    """A lookup would fail (a 503): a malformed key is a 401 without one, and a well-formed
    unknown key does reach it."""
    looked_up = []

    async def lookup(key: str) -> Principal | None:
        looked_up.append(key)
        raise OSError("the database was asked")

    bad = ["sk-ballast-short", "sk-ballast-" + "x" * 42, "sk-ballast-" + "x" * 44, "sk-ballast-" + "x" * 42 + "!",
           "sk-other-" + "x" * 45, "x" * 54]
    for key in bad:
        async with build(settings, Untouchable("postgres"), Untouchable("temporal"), key,
                         keys=KeyCache(lookup, 5)) as client:
            assert_openai_error(await client.get("/v1/models"), 401, code="invalid_api_key")
    assert looked_up == []
    good_shape = "sk-ballast-" + "x" * 43
    async with build(settings, Untouchable("postgres"), Untouchable("temporal"), good_shape,
                     keys=KeyCache(lookup, 5)) as client:
        assert_openai_error(await client.get("/v1/models"), 503, code="unavailable")
    assert looked_up == [good_shape]


def test_every_key_made_is_well_formed():
    import secrets

    assert all(tenant_store.well_formed(tenant_store.KEY_PREFIX + secrets.token_urlsafe(32)) for _ in range(200))


def test_the_hash_is_sha256_of_the_key():
    assert tenant_store.hash_key("sk-ballast-abc") == hashlib.sha256(b"sk-ballast-abc").hexdigest()
