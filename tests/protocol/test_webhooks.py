"""Webhook signing, judged by the official `openai` client's own verifier (not by ours):
what Ballast signs, `OpenAI().webhooks.unwrap` accepts and parses as the event it says;
a changed byte, another secret, another id or a stale timestamp it refuses."""

from __future__ import annotations

import base64
import json
import secrets
import time

import pytest
from openai import InvalidWebhookSignatureError, OpenAI

from protocol.webhooks import (
    BATCH_EVENTS,
    EVENT_TYPES,
    FINE_TUNE_EVENTS,
    SECRET_PREFIX,
    WebhookEvent,
    event_id,
    event_type,
    format_secret,
    raise_key,
    secret_key,
    signed_headers,
    verify,
)

SDK = OpenAI(api_key="unused")


def _secret() -> str:
    return format_secret(secrets.token_bytes(32))


@pytest.mark.parametrize("kind, status", [("batch", s) for s in BATCH_EVENTS]
                         + [("fine_tuning.job", s) for s in FINE_TUNE_EVENTS])
def test_the_sdk_unwraps_every_event_type_as_signed(kind, status):
    secret = _secret()
    job = ("batch_" if kind == "batch" else "ftjob-") + secrets.token_hex(12)
    type_ = event_type(kind, status)
    assert type_ in EVENT_TYPES
    event = WebhookEvent(event_id(f"{kind}:{job}", status), type_, int(time.time()) - 5, job, ["wh_1"])
    body = event.body()
    headers = signed_headers(secret, event.id, int(time.time()), body)

    parsed = SDK.webhooks.unwrap(body, headers, secret=secret)
    assert (parsed.id, parsed.type, parsed.created_at, parsed.data.id, parsed.object) == (
        event.id, type_, event.created_at, job, "event")
    assert type(parsed).__name__.lower().replace("_", "") == type_.replace(".", "").replace("_", "") + "webhookevent"
    # As text too, which is how most frameworks hand a body over.
    SDK.webhooks.verify_signature(body.decode(), headers, secret=secret)
    assert verify(secret, body, headers, int(time.time()))


def test_the_secret_is_whsec_and_32_random_bytes_and_the_key_is_its_decoding():
    s = _secret()
    assert s.startswith(SECRET_PREFIX) and len(secret_key(s)) == 32
    assert base64.b64decode(s[len(SECRET_PREFIX):]) == secret_key(s)
    assert _secret() != s


def _refused(body: bytes, headers: dict[str, str], secret: str) -> None:
    with pytest.raises(InvalidWebhookSignatureError):
        SDK.webhooks.unwrap(body, headers, secret=secret)
    assert not verify(secret, body, headers, int(time.time()))


def test_any_change_is_refused():
    secret = _secret()
    event = WebhookEvent("evt_" + "a" * 24, "batch.completed", 1_700_000_000, "batch_x")
    body = event.body()
    now = int(time.time())
    headers = signed_headers(secret, event.id, now, body)
    _refused(body.replace(b"batch_x", b"batch_y"), headers, secret)  # another body
    _refused(body, headers, _secret())  # another secret
    _refused(body, dict(headers, **{"webhook-id": "evt_" + "b" * 24}), secret)  # another id
    _refused(body, dict(headers, **{"webhook-timestamp": str(now - 1)}), secret)  # the timestamp is signed
    old = signed_headers(secret, event.id, now - 3600, body)  # signed right, an hour ago: a replay
    _refused(body, old, secret)


def test_the_body_is_openais_event_shape_and_stable():
    event = WebhookEvent("evt_1", "fine_tuning.job.succeeded", 1_700_000_000, "ftjob-1", ["wh_1", "wh_2"])
    assert json.loads(event.body()) == {"id": "evt_1", "object": "event", "created_at": 1_700_000_000,
                                        "type": "fine_tuning.job.succeeded", "data": {"id": "ftjob-1"}}
    assert event.body() == WebhookEvent.from_payload(dict(id="evt_1", type="fine_tuning.job.succeeded",
                                                          created_at=1_700_000_000, data_id="ftjob-1")).body()


def test_ids_and_keys_are_derived_once_per_job_and_status():
    assert event_id("batch:b1", "completed") == event_id("batch:b1", "completed")
    assert len({event_id("batch:b1", "completed"), event_id("batch:b1", "failed"),
                event_id("batch:b2", "completed")}) == 3
    assert raise_key("batch:b1", "completed") == "batch:b1:webhook:completed"
    assert event_type("batch", "in_progress") is None and event_type("fine_tuning.job", "running") is None
    assert event_type("fine_tuning.job", "completed") is None  # a fine-tune succeeds
