"""The webhook activities as the control worker runs them (its own database role), against
a real HTTP receiver on 127.0.0.1 that checks each delivery with the official `openai`
client:

- a job's end raises one event, to the endpoints subscribed then (another tenant's, a
  deleted one and one not subscribed to that type get nothing); again raises nothing new;
  an end nobody listens to raises nothing at all;
- a delivery the receiver verifies is journaled as delivered; one answered 503 raises (to
  be retried by Temporal), journaled with its status, and the retry sends the very same
  bytes under the same `webhook-id`, freshly signed;
- a redirect is not followed; an address in a denied network is not connected to; an
  endpoint deleted meanwhile gets nothing more and is journaled as abandoned.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest
from sqlalchemy import text
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.webhooks import NOT_DELIVERED, WebhookActivities
from config.webhooks import WebhookSettings
from journal import batch_store, finetune_store, webhook_store
from journal.events import append_one
from protocol.temporal import AbandonInput, DeliverInput, WebhookInput
from protocol.webhooks import format_secret
from tests.conftest import engine_at, role_url_for
from tests.e2e.webhook_receiver import Receiver

SETTINGS = WebhookSettings(webhook_timeout_s=5)


@pytest.fixture(scope="module")
async def control_db(db_url):
    async with engine_at(role_url_for(db_url, "control"), pool_size=2) as engine:
        yield engine


@pytest.fixture
async def acts(control_db):
    a = WebhookActivities(control_db, SETTINGS)
    yield a
    await a.close()


@pytest.fixture
def receiver():
    r = Receiver().listen()
    yield r
    r.stop()


@pytest.fixture
def tenant() -> str:
    return "wha-" + uuid.uuid4().hex[:10]


def env(attempt: int = 1, run: str = "run-1") -> ActivityEnvironment:
    e = ActivityEnvironment()
    e.info = dataclasses.replace(e.info, attempt=attempt, workflow_run_id=run)
    return e


async def register(db, tenant: str, url: str, events: list[str] | None = None) -> tuple[str, str]:
    """(id, secret) of a new endpoint, as the API registers one."""
    wid, secret = "wh_" + uuid.uuid4().hex[:24], format_secret(uuid.uuid4().bytes * 2)
    async with db.begin() as conn:
        assert await webhook_store.create_endpoint(conn, dict(
            id=wid, tenant=tenant, url=url, secret=secret, events=events or ["batch.failed", "batch.completed"],
            description=None, created_at=int(time.time())), 10)
    return wid, secret


async def failed_batch(db, tenant: str, at: int = 1_700_000_123) -> str:
    batch_id = "batch_" + uuid.uuid4().hex[:24]
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=batch_id, tenant=tenant, endpoint="/v1/completions",
                                                  input_file_id="file-x", completion_window="24h", metadata=None,
                                                  status="validating", created_at=at - 10, expires_at=at + 86400))
        assert await batch_store.move_status(conn, batch_id, "failed", at)
    return batch_id


async def attempts(db, event_id: str) -> list[dict]:
    async with db.connect() as conn:
        q = text("SELECT payload FROM events WHERE stream = :s AND type = 'webhook_attempt' ORDER BY version")
        return [r[0] for r in (await conn.execute(q, dict(s=f"webhook:{event_id}"))).all()]


async def test_a_jobs_end_raises_one_event_to_the_endpoints_subscribed_then(acts, db, tenant, receiver):
    mine, _ = await register(db, tenant, receiver.url)
    also, _ = await register(db, tenant, receiver.url, ["batch.failed"])
    await register(db, tenant, receiver.url, ["batch.completed"])  # not this type
    gone, _ = await register(db, tenant, receiver.url)
    async with db.begin() as conn:
        await webhook_store.delete_endpoint(conn, gone, tenant, int(time.time()))
    await register(db, "other-" + tenant, receiver.url)  # another tenant's
    batch_id = await failed_batch(db, tenant)

    plan = await env().run(acts.raise_webhook, WebhookInput("batch", batch_id))
    assert plan.event_id.startswith("evt_") and sorted(plan.endpoints) == sorted([mine, also])
    assert (plan.initial_interval_s, plan.max_interval_s, plan.give_up_after_s) == (1.0, 300.0, 3 * 86400.0)
    later, _ = await register(db, tenant, receiver.url)  # after the event was raised: not its endpoint
    again = await env(2).run(acts.raise_webhook, WebhookInput("batch", batch_id))
    assert again == plan and later not in again.endpoints
    async with db.connect() as conn:
        found = await webhook_store.raised(conn, plan.event_id)
    assert found is not None
    event, owner = found
    assert (owner, event.type, event.created_at, event.data_id) == (tenant, "batch.failed", 1_700_000_123, batch_id)


async def test_nothing_is_raised_where_nobody_listens(acts, db, tenant):
    batch_id = await failed_batch(db, tenant)
    assert (await env().run(acts.raise_webhook, WebhookInput("batch", batch_id))).endpoints == []
    async with db.connect() as conn:
        n = (await conn.execute(text("SELECT count(*) FROM events WHERE tenant = :t AND type LIKE 'webhook%'"),
                                dict(t=tenant))).scalar_one()
    assert n == 0
    # Nor for a job that has not ended, or does not exist.
    assert (await env().run(acts.raise_webhook, WebhookInput("batch", "batch_nope"))).endpoints == []


async def test_a_fine_tuning_jobs_end_is_its_own_event_type(acts, db, tenant, receiver):
    wid, secret = await register(db, tenant, receiver.url, ["fine_tuning.job.succeeded"])
    receiver.secret = secret
    job = dict(id="ftjob-" + uuid.uuid4().hex[:24], tenant=tenant, model="m", training_file="file-x",
               validation_file=None, hyperparameters={}, seed=1, suffix=None, metadata=None, status="running",
               error=None, fine_tuned_model=None, trained_tokens=None, result_files=[], created_at=1,
               finished_at=None)
    async with db.begin() as conn:
        await append_one(conn, finetune_store.created_event(job))
        assert await finetune_store.move_status(conn, job, "succeeded", finished_at=1_700_000_999)
    plan = await env().run(acts.raise_webhook, WebhookInput("fine_tuning.job", job["id"]))
    assert plan.endpoints == [wid]
    assert await env().run(acts.deliver_webhook, DeliverInput(plan.event_id, wid)) is True
    [got] = receiver.accepted()
    assert (got.event.type, got.event.data.id, got.event.created_at) == ("fine_tuning.job.succeeded", job["id"],
                                                                         1_700_000_999)


async def test_a_delivery_is_signed_journaled_and_retried_with_the_same_bytes(acts, db, control_db, tenant, receiver):
    wid, secret = await register(db, tenant, receiver.url)
    receiver.secret, receiver.fail_first = secret, 1
    plan = await env().run(acts.raise_webhook, WebhookInput("batch", await failed_batch(db, tenant)))

    with pytest.raises(ApplicationError, match="HTTP 503") as refused:
        await env(1).run(acts.deliver_webhook, DeliverInput(plan.event_id, wid))
    assert refused.value.type == NOT_DELIVERED and not refused.value.non_retryable
    assert await env(2).run(acts.deliver_webhook, DeliverInput(plan.event_id, wid)) is True

    first, second = receiver.deliveries
    assert (first.answered, second.answered) == (503, 200)
    assert first.webhook_id == second.webhook_id == plan.event_id  # a receiver de-duplicates by it
    assert first.body == second.body  # the same bytes, each time signed afresh
    assert second.event.id == plan.event_id and second.event.type == "batch.failed"
    assert second.headers["content-type"] == "application/json"
    journaled = await attempts(db, plan.event_id)
    assert [(a["attempt"], a["status_code"], a["delivered"], a["error"]) for a in journaled] == [
        (1, 503, False, "HTTP 503"), (2, 200, True, None)]
    async with control_db.connect() as conn:
        [seen] = await webhook_store.deliveries(conn, tenant, wid, 10)
    assert (seen["status"], seen["attempts"], seen["status_code"], seen["delivered_at"]) == (
        "delivered", 2, 200, journaled[1]["at"])


async def test_a_redirect_is_not_followed(acts, db, tenant, receiver):
    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.send_response(307)
            self.send_header("location", receiver.url)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        wid, _ = await register(db, tenant, f"http://127.0.0.1:{server.server_address[1]}/moved")
        plan = await env().run(acts.raise_webhook, WebhookInput("batch", await failed_batch(db, tenant)))
        with pytest.raises(ApplicationError, match="HTTP 307"):
            await env().run(acts.deliver_webhook, DeliverInput(plan.event_id, wid))
    finally:
        server.shutdown()
        server.server_close()
    assert receiver.deliveries == []  # never reached where it pointed
    [a] = await attempts(db, plan.event_id)
    assert a["status_code"] == 307 and "not followed" in a["error"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
async def test_an_address_in_a_denied_network_is_never_connected_to(control_db, db, tenant, receiver, host):
    guarded = WebhookActivities(control_db, WebhookSettings(webhook_denied_networks="127.0.0.0/8, ::1/128"))
    try:
        wid, _ = await register(db, tenant, receiver.url.replace("127.0.0.1", host))
        plan = await env().run(guarded.raise_webhook, WebhookInput("batch", await failed_batch(db, tenant)))
        with pytest.raises(ApplicationError, match="may not reach"):
            await env().run(guarded.deliver_webhook, DeliverInput(plan.event_id, wid))
    finally:
        await guarded.close()
    assert receiver.deliveries == []
    [a] = await attempts(db, plan.event_id)
    assert a["status_code"] is None and not a["delivered"]


async def test_an_endpoint_deleted_meanwhile_gets_nothing_more(acts, db, control_db, tenant, receiver):
    wid, _ = await register(db, tenant, receiver.url)
    plan = await env().run(acts.raise_webhook, WebhookInput("batch", await failed_batch(db, tenant)))
    async with db.begin() as conn:
        await webhook_store.delete_endpoint(conn, wid, tenant, int(time.time()))
    assert await env().run(acts.deliver_webhook, DeliverInput(plan.event_id, wid)) is False
    assert receiver.deliveries == [] and await attempts(db, plan.event_id) == []
    # Giving up after the retries journals the same way, once.
    await env().run(acts.abandon_webhook, AbandonInput(plan.event_id, wid, "retries_exhausted", "HTTP 503"))
    async with control_db.connect() as conn:
        [seen] = await webhook_store.deliveries(conn, tenant, wid, 10)
    assert (seen["status"], seen["abandoned"]) == ("abandoned", "endpoint_deleted")
