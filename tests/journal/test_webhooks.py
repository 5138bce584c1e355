"""Webhook endpoints and their journal, on the real server as each service's own role:

- the API's role registers, lists, reads and soft-deletes endpoints, and can never read a
  secret back (nor change an endpoint's URL or secret, nor remove its row); the control
  worker's reads endpoints with their secrets and writes none; the engine's has nothing;
- a tenant's endpoints are bounded, also when registrations race;
- an event is raised once per (job, terminal status): a second raise, whatever endpoints
  it names, returns the first; attempts and abandonment are journaled; the deliveries
  read back what they add up to.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import psycopg
import pytest
from psycopg import errors as pgerr
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from config.database import libpq_url
from journal import webhook_store
from journal.events import NewEvent, append_one
from protocol.events import EventType
from protocol.webhooks import WebhookAbandoned, WebhookAttempt, WebhookEvent, event_id
from tests.conftest import engine_at, role_url_for


@pytest.fixture(scope="module")
async def api_db(db_url):
    async with engine_at(role_url_for(db_url, "api"), pool_size=4) as engine:
        yield engine


@pytest.fixture(scope="module")
async def control_db(db_url):
    async with engine_at(role_url_for(db_url, "control"), pool_size=2) as engine:
        yield engine


@pytest.fixture
def tenant() -> str:
    return "wh-" + uuid.uuid4().hex[:10]


def endpoint(tenant: str, **over) -> dict:
    return dict(id="wh_" + uuid.uuid4().hex[:24], tenant=tenant, url="https://example.com/hook",
                secret="whsec_" + uuid.uuid4().hex, events=["batch.completed", "batch.failed"], description=None,
                created_at=int(time.time())) | over


async def test_the_api_role_registers_lists_and_deletes_but_never_reads_a_secret(api_db, control_db, tenant):
    a, b = endpoint(tenant), endpoint(tenant, events=["fine_tuning.job.succeeded"])
    async with api_db.begin() as conn:
        assert await webhook_store.create_endpoint(conn, a, 10)
        assert await webhook_store.create_endpoint(conn, b, 10)
    async with api_db.connect() as conn:
        listed = await webhook_store.list_endpoints(conn, tenant)
        assert [r["id"] for r in listed] == sorted([a["id"], b["id"]], key=lambda i: (listed[0]["created_at"], i))
        assert all("secret" not in r for r in listed)
        got = await webhook_store.get_endpoint(conn, a["id"], tenant)
        assert got is not None and got["url"] == a["url"] and "secret" not in got
        assert await webhook_store.get_endpoint(conn, a["id"], "another-tenant") is None
        with pytest.raises(DBAPIError, match="permission denied"):
            await conn.execute(text("SELECT secret FROM webhooks WHERE id = :id"), dict(id=a["id"]))
    async with control_db.connect() as conn:
        assert (await webhook_store.signing_endpoint(conn, a["id"]) or {})["secret"] == a["secret"]
        assert await webhook_store.subscribers(conn, tenant, "batch.completed") == [a["id"]]
        assert await webhook_store.subscribers(conn, tenant, "fine_tuning.job.succeeded") == [b["id"]]
        assert await webhook_store.subscribers(conn, tenant, "batch.expired") == []
    async with api_db.begin() as conn:
        assert not await webhook_store.delete_endpoint(conn, a["id"], "another-tenant", int(time.time()))
        assert await webhook_store.delete_endpoint(conn, a["id"], tenant, int(time.time()))
        assert not await webhook_store.delete_endpoint(conn, a["id"], tenant, int(time.time()))  # once
    async with api_db.connect() as conn:
        assert [r["id"] for r in await webhook_store.list_endpoints(conn, tenant)] == [b["id"]]
        assert await webhook_store.get_endpoint(conn, a["id"], tenant) is None
    async with control_db.connect() as conn:
        assert await webhook_store.subscribers(conn, tenant, "batch.completed") == []
        assert (await webhook_store.signing_endpoint(conn, a["id"]) or {})["deleted_at"] is not None


@pytest.mark.parametrize("kind, sql", [
    ("api", "SELECT secret FROM webhooks"),
    ("api", "SELECT * FROM webhooks"),
    ("api", "UPDATE webhooks SET url = 'http://mallory'"),
    ("api", "UPDATE webhooks SET secret = 'whsec_mine'"),
    ("api", "DELETE FROM webhooks"),
    ("control", "UPDATE webhooks SET url = 'http://mallory'"),
    ("control", "INSERT INTO webhooks (id, tenant, url, secret, events, created_at) "
                "VALUES ('wh_x', 't', 'http://x', 's', '{}', 0)"),
    ("control", "DELETE FROM webhooks"),
    ("engine", "SELECT id FROM webhooks"),
    ("engine", "INSERT INTO webhooks (id, tenant, url, secret, events, created_at) "
               "VALUES ('wh_x', 't', 'http://x', 's', '{}', 0)"),
])
def test_what_each_role_may_not_do_to_webhooks(db_url, kind, sql):
    with psycopg.connect(libpq_url(role_url_for(db_url, kind))) as conn, pytest.raises(pgerr.InsufficientPrivilege):
        conn.execute(sql)


@pytest.mark.parametrize("kind", ["webhook_event", "webhook_attempt", "webhook_abandoned"])
def test_an_engine_appends_no_webhook_event(db_url, kind):
    with psycopg.connect(libpq_url(role_url_for(db_url, "engine"))) as conn:
        with pytest.raises(pgerr.InsufficientPrivilege, match="row-level security"):
            conn.execute("INSERT INTO events (stream, version, type, payload, idempotency_key, tenant) "
                         "VALUES (%s, 1, %s, '{}', %s, 't')", (f"s-{uuid.uuid4().hex}", kind, uuid.uuid4().hex))


async def test_a_tenant_holds_at_most_its_endpoints_also_when_they_race(api_db, tenant):
    async with api_db.begin() as conn:
        for _ in range(2):
            assert await webhook_store.create_endpoint(conn, endpoint(tenant), 3)

    async def one() -> bool:
        async with api_db.begin() as conn:
            return await webhook_store.create_endpoint(conn, endpoint(tenant), 3)

    assert sorted(await asyncio.gather(one(), one(), one())) == [False, False, True]
    async with api_db.connect() as conn:
        ids = [r["id"] for r in await webhook_store.list_endpoints(conn, tenant)]
    assert len(ids) == 3
    async with api_db.begin() as conn:  # a deleted one frees its place
        assert await webhook_store.delete_endpoint(conn, ids[0], tenant, int(time.time()))
        assert await webhook_store.create_endpoint(conn, endpoint(tenant), 3)


async def test_an_event_is_raised_once_and_its_deliveries_add_up(control_db, api_db, db, tenant):
    a, b = endpoint(tenant), endpoint(tenant)
    async with api_db.begin() as conn:
        for e in (a, b):
            await webhook_store.create_endpoint(conn, e, 10)
    job = "batch_" + uuid.uuid4().hex[:24]
    stream = f"batch:{job}"
    eid = event_id(stream, "completed")
    first = WebhookEvent(eid, "batch.completed", 1_700_000_000, job, [a["id"], b["id"]])
    async with control_db.begin() as conn:
        assert await webhook_store.raise_event(conn, tenant, stream, "completed", first) == first
    # A retry that would name other endpoints (one was registered since) gets the first.
    async with control_db.begin() as conn:
        again = WebhookEvent(eid, "batch.completed", 1_700_000_000, job, [a["id"]])
        assert await webhook_store.raise_event(conn, tenant, stream, "completed", again) == first
        assert await webhook_store.raised(conn, eid) == (first, tenant)
    async with control_db.begin() as conn:  # a second raise under the same key, however made, is refused
        with pytest.raises(Exception, match="already journaled"):
            await append_one(conn, NewEvent(f"webhook:{eid}x", EventType.WEBHOOK_EVENT, {"id": "other"},
                                            f"{stream}:webhook:completed", tenant))
    async with db.connect() as conn:
        n = (await conn.execute(text("SELECT count(*) FROM events WHERE idempotency_key = :k"),
                                dict(k=f"{stream}:webhook:completed"))).scalar_one()
    assert n == 1

    async with control_db.begin() as conn:
        await webhook_store.record_attempt(conn, tenant, WebhookAttempt(eid, a["id"], 1, 100, 503, "HTTP 503", False),
                                           "run1")
        await webhook_store.record_attempt(conn, tenant, WebhookAttempt(eid, a["id"], 2, 101, None,
                                                                        "ConnectError", False), "run1")
        await webhook_store.record_attempt(conn, tenant, WebhookAttempt(eid, a["id"], 3, 104, 200, None, True), "run1")
        # The same attempt journaled again (a retried append) is one row.
        await webhook_store.record_attempt(conn, tenant, WebhookAttempt(eid, a["id"], 3, 104, 200, None, True), "run1")
        await webhook_store.abandon(conn, tenant, WebhookAbandoned(eid, b["id"], "endpoint_deleted"))
        await webhook_store.abandon(conn, tenant, WebhookAbandoned(eid, b["id"], "endpoint_deleted"))
    async with api_db.connect() as conn:
        [got_a] = await webhook_store.deliveries(conn, tenant, a["id"], 10)
        [got_b] = await webhook_store.deliveries(conn, tenant, b["id"], 10)
        assert await webhook_store.deliveries(conn, "another-tenant", a["id"], 10) == []
    assert got_a | dict(event_id=eid, type="batch.completed", created_at=1_700_000_000, attempts=3, status_code=200,
                        error=None, attempted_at=104, delivered_at=104, status="delivered") == got_a
    assert (got_b["attempts"], got_b["status"], got_b["abandoned"], got_b["delivered_at"]) == (
        0, "abandoned", "endpoint_deleted", None)
    async with db.connect() as conn:  # the audit trail, in plain SQL
        rows = (await conn.execute(text("SELECT type, count(*) FROM events WHERE stream = :s GROUP BY 1 ORDER BY 1"),
                                   dict(s=f"webhook:{eid}"))).all()
    assert [tuple(r) for r in rows] == [("webhook_abandoned", 1), ("webhook_attempt", 3), ("webhook_event", 1)]
