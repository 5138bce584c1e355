"""Webhook endpoints (the `webhooks` table, written by the API) and the journal's record of
every event raised for them and every delivery attempt (stream `webhook:<event id>`;
payloads in protocol/webhooks.py).

The API's role reads every column of an endpoint but its secret (WEBHOOK_PUBLIC: a
`select(webhooks)` would be refused); only the control worker's reads `signing_endpoint`.

Audit in SQL: `SELECT type, payload FROM events WHERE stream = 'webhook:<evt_…>' ORDER BY version`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.events import NewEvent, append_one
from journal.schema import WEBHOOK_PUBLIC, events, webhooks
from protocol import keys
from protocol.events import EventType
from protocol.webhooks import WebhookAbandoned, WebhookAttempt, WebhookEvent, raise_key

# -- endpoints ------------------------------------------------------------------------


async def lock_tenant(conn: AsyncConnection, tenant: str) -> None:
    """Serialise the tenant's endpoint registrations until the transaction ends: two
    cannot both take its last free place."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('ballast.webhooks:' || :t, 0))"),
                       dict(t=tenant))


async def live_count(conn: AsyncConnection, tenant: str) -> int:
    q = select(func.count()).select_from(webhooks).where(webhooks.c.tenant == tenant, webhooks.c.deleted_at.is_(None))
    return int((await conn.execute(q)).scalar_one())


async def create_endpoint(conn: AsyncConnection, row: dict[str, Any], most: int) -> bool:
    """Register the endpoint (`row`: the table's columns but `deleted_at`) unless its tenant
    has `most` live ones already (False). Call inside a transaction."""
    await lock_tenant(conn, row["tenant"])
    if await live_count(conn, row["tenant"]) >= most:
        return False
    await conn.execute(webhooks.insert().values(**row))
    return True


def _public(r: Any) -> dict[str, Any]:
    return dict(r._mapping)


async def list_endpoints(conn: AsyncConnection, tenant: str) -> list[dict[str, Any]]:
    """The tenant's live endpoints, oldest first; no secrets."""
    q = (select(*WEBHOOK_PUBLIC).where(webhooks.c.tenant == tenant, webhooks.c.deleted_at.is_(None))
         .order_by(webhooks.c.created_at, webhooks.c.id))
    return [_public(r) for r in (await conn.execute(q)).all()]


async def get_endpoint(conn: AsyncConnection, endpoint_id: str, tenant: str) -> dict[str, Any] | None:
    """The tenant's live endpoint; None for another tenant's, a deleted or an unknown one."""
    q = select(*WEBHOOK_PUBLIC).where(webhooks.c.id == endpoint_id, webhooks.c.tenant == tenant,
                                      webhooks.c.deleted_at.is_(None))
    row = (await conn.execute(q)).first()
    return _public(row) if row else None


async def delete_endpoint(conn: AsyncConnection, endpoint_id: str, tenant: str, at: int) -> bool:
    """Soft-delete the tenant's live endpoint (deliveries still due to it stop); False if
    there is none. Its events and attempts stay in the journal."""
    q = (update(webhooks).where(webhooks.c.id == endpoint_id, webhooks.c.tenant == tenant,
                                webhooks.c.deleted_at.is_(None)).values(deleted_at=int(at)))
    return (await conn.execute(q)).rowcount == 1


async def subscribers(conn: AsyncConnection, tenant: str, event_type: str) -> list[str]:
    """The tenant's live endpoints that receive `event_type`, oldest first."""
    q = (select(webhooks.c.id).where(webhooks.c.tenant == tenant, webhooks.c.deleted_at.is_(None),
                                     webhooks.c.events.any_() == event_type)
         .order_by(webhooks.c.created_at, webhooks.c.id))
    return list((await conn.execute(q)).scalars().all())


async def signing_endpoint(conn: AsyncConnection, endpoint_id: str) -> dict[str, Any] | None:
    """The endpoint with its secret, deleted or not (the control worker's role only)."""
    row = (await conn.execute(select(webhooks).where(webhooks.c.id == endpoint_id))).first()
    return dict(row._mapping) if row else None


# -- events and attempts --------------------------------------------------------------


async def raised(conn: AsyncConnection, event_id: str) -> tuple[WebhookEvent, str] | None:
    """The event as journaled, and its tenant; None if it was never raised."""
    q = select(events.c.payload, events.c.tenant).where(events.c.stream == keys.webhook(event_id),
                                                        events.c.type == EventType.WEBHOOK_EVENT)
    row = (await conn.execute(q)).first()
    return None if row is None else (WebhookEvent.from_payload(row.payload), row.tenant)


async def raise_event(conn: AsyncConnection, tenant: str, job_stream: str, status: str,
                      event: WebhookEvent) -> WebhookEvent:
    """Journal the event a job's terminal status raises, once: keyed by (job, status). A
    retry finds the one raised first and returns it (its endpoints as they were then)."""
    if (first := await raised(conn, event.id)) is not None:
        return first[0]
    await append_one(conn, NewEvent(keys.webhook(event.id), EventType.WEBHOOK_EVENT, asdict(event),
                                    raise_key(job_stream, status), tenant))
    return event


async def record_attempt(conn: AsyncConnection, tenant: str, attempt: WebhookAttempt, run: str) -> None:
    """Journal one delivery attempt. `run`: the delivering workflow's run, so that attempt
    numbers restarting in another run never collide."""
    stream = keys.webhook(attempt.event_id)
    key = f"{stream}:attempt:{attempt.endpoint_id}:{run}:{attempt.attempt}"
    await append_one(conn, NewEvent(stream, EventType.WEBHOOK_ATTEMPT, asdict(attempt), key, tenant))


async def abandon(conn: AsyncConnection, tenant: str, abandoned: WebhookAbandoned) -> bool:
    """Journal that the event will not reach the endpoint, once per event and endpoint: the
    first reason journaled stands (False: one was, this one is not kept)."""
    stream = keys.webhook(abandoned.event_id)
    key = f"{stream}:abandoned:{abandoned.endpoint_id}"
    if (await conn.execute(select(events.c.position).where(events.c.idempotency_key == key))).first() is not None:
        return False
    await append_one(conn, NewEvent(stream, EventType.WEBHOOK_ABANDONED, asdict(abandoned), key, tenant))
    return True


# Each event raised for the endpoint, newest first, with what its attempts came to. The
# events come by the `events_type` index (type, position), newest first.
_DELIVERIES = text(
    """
    SELECT r.payload->>'id' AS event_id, r.payload->>'type' AS type,
           (r.payload->>'created_at')::bigint AS created_at,
           coalesce(a.attempts, 0) AS attempts, a.status_code, a.error, a.attempted_at, a.delivered_at,
           g.payload->>'reason' AS abandoned
    FROM events r
    LEFT JOIN LATERAL (
      SELECT count(*) AS attempts,
             (array_agg((x.payload->>'status_code')::int ORDER BY x.version DESC))[1] AS status_code,
             (array_agg(x.payload->>'error' ORDER BY x.version DESC))[1] AS error,
             max((x.payload->>'at')::bigint) AS attempted_at,
             min((x.payload->>'at')::bigint) FILTER (WHERE (x.payload->>'delivered')::boolean) AS delivered_at
      FROM events x
      WHERE x.stream = r.stream AND x.type = 'webhook_attempt' AND x.payload->>'endpoint_id' = :endpoint
    ) a ON true
    LEFT JOIN events g ON g.idempotency_key = r.stream || ':abandoned:' || :endpoint
    WHERE r.type = 'webhook_event' AND r.tenant = :tenant
      AND r.payload->'endpoints' @> jsonb_build_array(CAST(:endpoint AS text))
    ORDER BY r.position DESC
    LIMIT :limit
    """
)


async def deliveries(conn: AsyncConnection, tenant: str, endpoint_id: str, limit: int) -> list[dict[str, Any]]:
    """The endpoint's most recent events: each with its attempts, the last one's status
    code and error, when it was delivered, and `status`: delivered | pending | abandoned
    (then `abandoned` says why)."""
    rows = (await conn.execute(_DELIVERIES, dict(tenant=tenant, endpoint=endpoint_id, limit=limit))).all()
    out = []
    for r in rows:
        d = dict(r._mapping)
        d["status"] = "delivered" if d["delivered_at"] is not None else ("abandoned" if d["abandoned"] else "pending")
        out.append(d)
    return out
