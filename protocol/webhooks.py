"""Completion webhooks: what a tenant's endpoint receives, how it is signed, and what the
journal keeps of each event and each delivery attempt.

The wire format is OpenAI's, which is the Standard Webhooks spec
(https://www.standardwebhooks.com): a POST whose body is

    {"id": "evt_…", "object": "event", "created_at": <unix s>, "type": "batch.completed",
     "data": {"id": "batch_…"}}

with the headers `webhook-id` (the event's id: the same on every retry, so a receiver
de-duplicates by it), `webhook-timestamp` (unix seconds of this attempt) and
`webhook-signature: v1,<base64 HMAC-SHA256(key, f"{id}.{timestamp}.{body}")>`, the key
being the base64-decoded part of the endpoint's secret `whsec_<base64 of 32 bytes>`. The
official `openai` client's `webhooks.unwrap(body, headers, secret=…)` verifies it.

Journal events (`protocol.events.EventType`), stream `webhook:<event id>`:
- `webhook_event` (`WebhookEvent`): raised once per (job, terminal status), keyed so;
  names the endpoints it goes to, as subscribed when it was raised;
- `webhook_attempt` (`WebhookAttempt`): one per delivery attempt to one endpoint;
- `webhook_abandoned` (`WebhookAbandoned`): an endpoint that will not get it (deleted, or
  every retry spent).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any, Literal

# What a terminal status of each kind of job is announced as (OpenAI's event types).
BATCH_EVENTS = {s: f"batch.{s}" for s in ("completed", "failed", "expired", "cancelled")}
FINE_TUNE_EVENTS = {s: f"fine_tuning.job.{s}" for s in ("succeeded", "failed", "cancelled")}
EVENT_TYPES: tuple[str, ...] = (*BATCH_EVENTS.values(), *FINE_TUNE_EVENTS.values())

Kind = Literal["batch", "fine_tuning.job"]
KINDS: dict[str, dict[str, str]] = {"batch": BATCH_EVENTS, "fine_tuning.job": FINE_TUNE_EVENTS}

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
# Headers of every delivery besides the signature's three.
CONTENT_TYPE = "application/json"
USER_AGENT = "Ballast-Webhooks/1"


def event_type(kind: str, status: str) -> str | None:
    """The event a job of `kind` ending `status` raises; None for a status that is not an end."""
    return KINDS.get(kind, {}).get(status)


def event_id(job_stream: str, status: str) -> str:
    """The event's id, derived from what it announces: a retried raise names the same one."""
    return "evt_" + hashlib.sha256(f"{job_stream}:{status}".encode()).hexdigest()[:24]


def raise_key(job_stream: str, status: str) -> str:
    """The idempotency key of the one `webhook_event` a job's terminal status raises."""
    return f"{job_stream}:webhook:{status}"


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_…` secret (as the openai client reads it: base64 after the
    prefix; any other string is its own UTF-8 bytes)."""
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret[len(SECRET_PREFIX):])
    return secret.encode()


def format_secret(raw: bytes) -> str:
    return SECRET_PREFIX + base64.b64encode(raw).decode()


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64>`: the Standard Webhooks signature of exactly these body bytes."""
    signed = msg_id.encode() + b"." + str(timestamp).encode() + b"." + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(secret, msg_id, timestamp, body),
            "content-type": CONTENT_TYPE, "user-agent": USER_AGENT}


def verify(secret: str, body: bytes, headers: dict[str, str], now: int, tolerance_s: int = 300) -> bool:
    """Whether `headers` sign `body` with `secret`, within `tolerance_s` of `now` (what a
    receiver checks; the openai client's verify_signature does the same)."""
    h = {k.lower(): v for k, v in headers.items()}
    try:
        ts = int(h["webhook-timestamp"])
        msg_id, sent = h["webhook-id"], h["webhook-signature"].split()
    except (KeyError, ValueError):
        return False
    if abs(now - ts) > tolerance_s:
        return False
    want = signature(secret, msg_id, ts, body)
    return any(hmac.compare_digest(want, s) for s in sent)


# -- the journal's payloads --------------------------------------------------------------
#
# As protocol/events.py's: a field is never added to an event type once written.


@dataclass(frozen=True)
class WebhookEvent:
    """`webhook_event`: what is announced, and to which of the tenant's endpoints."""

    id: str  # evt_…: the body's `id` and every delivery's `webhook-id`
    type: str  # one of EVENT_TYPES
    created_at: int  # unix seconds: when the job reached the status
    data_id: str  # the batch's or the job's id
    endpoints: list[str] = field(default_factory=list)  # wh_… ids, as subscribed when raised

    def body(self) -> bytes:
        """The body every delivery of it sends, byte for byte (and signs)."""
        wire = {"id": self.id, "object": "event", "created_at": self.created_at, "type": self.type,
                "data": {"id": self.data_id}}
        return json.dumps(wire, separators=(",", ":")).encode()

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> WebhookEvent:
        return cls(str(d["id"]), str(d["type"]), int(d["created_at"]), str(d["data_id"]),
                   [str(e) for e in d.get("endpoints", [])])


@dataclass(frozen=True)
class WebhookAttempt:
    """`webhook_attempt`: one POST of an event to one endpoint, and what came back."""

    event_id: str
    endpoint_id: str
    attempt: int  # 1 first (Temporal's attempt number of the delivery)
    at: int  # unix seconds: the attempt's `webhook-timestamp`
    status_code: int | None  # None: no response (refused, unreachable, timed out)
    error: str | None  # why it did not count as delivered; None when it did
    delivered: bool  # a 2xx
    duration_ms: int = 0


@dataclass(frozen=True)
class WebhookAbandoned:
    """`webhook_abandoned`: the event will not reach this endpoint."""

    event_id: str
    endpoint_id: str
    reason: str  # "endpoint_deleted" | "retries_exhausted"
    detail: str = ""


def delivered(status_code: int | None) -> bool:
    """A 2xx, and only a 2xx (a redirect is not followed: it is a failed attempt)."""
    return status_code is not None and 200 <= status_code < 300


def webhook_queue(control_queue: str) -> str:
    """The task queue deliveries run on, beside the control queue: a slow receiver holds
    only webhook slots, never the batches' orchestration."""
    return f"{control_queue}-webhooks"
