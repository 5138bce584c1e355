"""Completion webhooks on the real stack: a tenant registers three endpoints (real HTTP
receivers on 127.0.0.1 that check every delivery with the official `openai` client's
`webhooks.unwrap`), then a batch completes, another is cancelled and a fine-tuning job
fails its validation:

- every end reaches every endpoint subscribed to its type, exactly those types, each
  delivery's signature valid, the same event id (`webhook-id`) at every endpoint;
- an endpoint in an outage (503 for its first deliveries; another not even listening
  until its first attempts have failed) gets every event once it is back: none lost, a
  duplicate at most, always under the same `webhook-id`;
- the deliveries show in GET /v1/webhooks/{id}/deliveries, and in the journal by SQL:
  one `webhook_event` per job, every attempt with its status code or error.
"""

from __future__ import annotations

import io
import json
import time
import uuid

import httpx
import psycopg
import pytest
from openai import OpenAI

from ballast import procs
from config.database import libpq_url
from tests.e2e.conftest import WAIT_S, make_key
from tests.e2e.test_batch import chat_line, submit, wait_for
from tests.e2e.test_fine_tuning import wait_final
from tests.e2e.webhook_receiver import Receiver

pytestmark = pytest.mark.e2e


def _journal(db_url: str, sql: str, *params) -> list[tuple]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        return conn.execute(sql, params).fetchall()


def _ids_by_type(r: Receiver) -> dict[str, set[tuple[str, str]]]:
    """Each event type it verified: the (event id, job id) pairs, duplicates folded by webhook-id."""
    out: dict[str, set[tuple[str, str]]] = {}
    for d in r.accepted():
        assert d.webhook_id == d.event.id  # the header names the event: receivers de-duplicate by it
        out.setdefault(d.event.type, set()).add((d.event.id, d.event.data.id))
    return out


def test_every_end_reaches_every_endpoint_through_outages(stack, db_url, gate, tiny_model):
    tenant = f"hooks-{uuid.uuid4().hex[:8]}"
    key = make_key(db_url, tenant)
    client = OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
    api = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    steady, flaky = Receiver().listen(), Receiver(fail_first=2).listen()
    late = Receiver(port=procs.free_port())  # registered, but not listening yet
    try:
        hooks = {}
        for name, r, events in (("steady", steady, None), ("flaky", flaky, ["batch.completed", "batch.cancelled"]),
                                ("late", late, ["batch.completed"])):
            made = api.post("/v1/webhooks", json=dict(url=r.url, events=events, description=name))
            assert made.status_code == 200, made.text
            r.secret, hooks[name] = made.json()["secret"], made.json()["id"]

        # A batch that completes; one cancelled while the gate holds its items; a fine-tuning
        # job whose file fails validation.
        done = wait_for(client, submit(client, [chat_line(f"c{i}", f"hello {i}", 4) for i in range(2)]).id)
        assert done.status == "completed", done
        gate.hold(0)
        held = submit(client, [chat_line("c0", "never", 8)])
        client.batches.cancel(held.id)
        cancelled = wait_for(client, held.id)
        assert cancelled.status == "cancelled", cancelled
        gate.release()
        bad = client.files.create(file=("bad.jsonl", io.BytesIO(b"{oops\n")), purpose="fine-tune")
        job = wait_final(client, client.fine_tuning.jobs.create(model=tiny_model.name, training_file=bad.id).id)
        assert job.status == "failed", job

        # The late receiver comes up once its first attempts have failed to connect.
        deadline = time.monotonic() + WAIT_S
        while not _journal(db_url, "SELECT 1 FROM events WHERE type = 'webhook_attempt' AND tenant = %s "
                                   "AND payload->>'endpoint_id' = %s", tenant, hooks["late"]):
            assert time.monotonic() < deadline, "no attempt to the endpoint that is down"
            time.sleep(0.1)
        late.listen()

        want = {"batch.completed": done.id, "batch.cancelled": cancelled.id, "fine_tuning.job.failed": job.id}
        steady.wait(lambda r: set(_ids_by_type(r)) == set(want), "steady did not get every event", WAIT_S)
        flaky.wait(lambda r: set(_ids_by_type(r)) == {"batch.completed", "batch.cancelled"},
                   "flaky did not get its events", WAIT_S)
        late.wait(lambda r: set(_ids_by_type(r)) == {"batch.completed"}, "late did not get its event", WAIT_S)
    finally:
        for r in (steady, flaky, late):
            r.stop()

    # Exactly the types each subscribed to, one event per job, the same id at every endpoint.
    got = _ids_by_type(steady)
    assert {t: {job_id for _, job_id in pairs} for t, pairs in got.items()} == {t: {i} for t, i in want.items()}
    assert all(len(pairs) == 1 for pairs in got.values())
    event_ids = {t: next(iter(pairs))[0] for t, pairs in got.items()}
    assert _ids_by_type(flaky) == {t: got[t] for t in ("batch.completed", "batch.cancelled")}
    assert _ids_by_type(late) == {"batch.completed": got["batch.completed"]}
    for r in (steady, flaky, late):
        assert all(d.answered in (200, 503) for d in r.deliveries), r.deliveries  # no signature failed
        for d in r.accepted():  # each attempt signed afresh, and the body is what was signed
            assert abs(d.timestamp - time.time()) < WAIT_S + 60
            assert json.loads(d.body)["id"] == d.webhook_id
    assert [d.answered for d in flaky.deliveries][:2] == [503, 503]  # its outage, retried through

    # What the API shows, attempt by attempt.
    for name, r in (("steady", steady), ("flaky", flaky), ("late", late)):
        listed = api.get(f"/v1/webhooks/{hooks[name]}/deliveries").json()["data"]
        assert {d["event_id"] for d in listed} == {e for pairs in _ids_by_type(r).values() for e, _ in pairs}
        assert all(d["status"] == "delivered" and d["last_status_code"] == 200 and d["delivered_at"] for d in listed)
        # Every request a receiver saw is an attempt journaled (and the late one's refused connections too).
        assert sum(d["attempts"] for d in listed) >= len(r.deliveries) and (
            name == "late" or sum(d["attempts"] for d in listed) == len(r.deliveries)), (name, listed, r.deliveries)
    flaky_listed = api.get(f"/v1/webhooks/{hooks['flaky']}/deliveries").json()["data"]
    assert sum(d["attempts"] for d in flaky_listed) >= 4  # two events, two 503s
    [late_listed] = api.get(f"/v1/webhooks/{hooks['late']}/deliveries").json()["data"]
    assert late_listed["attempts"] >= 2

    # And in the journal, in SQL: one event raised per job, every attempt recorded.
    raised = _journal(db_url, "SELECT payload->>'type', payload->>'id', payload->>'data_id', "
                              "jsonb_array_length(payload->'endpoints') FROM events "
                              "WHERE type = 'webhook_event' AND tenant = %s ORDER BY position", tenant)
    assert sorted(raised) == sorted([("batch.completed", event_ids["batch.completed"], done.id, 3),
                                     ("batch.cancelled", event_ids["batch.cancelled"], cancelled.id, 2),
                                     ("fine_tuning.job.failed", event_ids["fine_tuning.job.failed"], job.id, 1)])
    errors = _journal(db_url, "SELECT payload->>'error' FROM events WHERE type = 'webhook_attempt' AND tenant = %s "
                              "AND payload->>'endpoint_id' = %s ORDER BY position", tenant, hooks["late"])
    assert errors[0][0] and "Connect" in errors[0][0] and errors[-1][0] is None, errors
    delivered = _journal(db_url, "SELECT DISTINCT payload->>'event_id', payload->>'endpoint_id' FROM events "
                                 "WHERE type = 'webhook_attempt' AND tenant = %s AND (payload->>'delivered')::boolean",
                         tenant)
    assert len(delivered) == 3 + 2 + 1
