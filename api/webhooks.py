"""/v1/webhooks: a tenant's endpoints for completion events (its batches' and fine-tuning
jobs' ends), and what was delivered to each.

`POST` registers one and answers its signing secret, once: no later call shows it (the
API's database role cannot even read it back). Deliveries are signed and retried as
protocol/webhooks.py and workflows/webhooks.py say; docs/api.md#webhooks tells a receiver
how to check them. At most `max_webhooks_per_tenant` live endpoints per tenant.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api.deps import ServicesDep, TenantDep
from api.errors import APIError, check_text, not_found, require_id
from journal import webhook_store
from protocol.schema import errors
from protocol.webhooks import EVENT_TYPES, SECRET_BYTES, format_secret

router = APIRouter(prefix="/v1/webhooks")

MAX_URL = 2048  # characters
MAX_DESCRIPTION = 512
EventType = Literal["batch.completed", "batch.failed", "batch.expired", "batch.cancelled",
                    "fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]
# Not retried by OpenAI's clients: waiting frees no place, deleting an endpoint does.
_NO_RETRY = {"x-should-retry": "false"}


class CreateWebhook(BaseModel):
    url: str = Field(max_length=MAX_URL, description="Where events are POSTed: an absolute http(s) URL.")
    events: list[EventType] | None = Field(
        default=None, min_length=1, max_length=len(EVENT_TYPES),
        description="The event types it receives; absent or null: all of them.")
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION)


def webhook_object(row: dict[str, Any], secret: str | None = None) -> dict[str, Any]:
    out = dict(id=row["id"], object="webhook", url=row["url"], events=list(row["events"]),
               description=row["description"], created_at=row["created_at"])
    if secret is not None:
        out["secret"] = secret
    return out


def check_url(url: str) -> str:
    """An absolute http(s) URL with a host, no credentials and no fragment, else a 400."""
    check_text(url, "url")

    def bad(why: str) -> APIError:
        return APIError(400, f"url must be an absolute http or https URL: {why}.", param="url", code="invalid_url")

    if url != url.strip() or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise bad("it holds whitespace or control characters")
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port out of range is a ValueError
    except ValueError as err:
        raise bad(str(err)) from None
    if parts.scheme not in ("http", "https"):
        raise bad(f"scheme {parts.scheme or '(none)'!r}")
    if not parts.hostname:
        raise bad("it names no host")
    if "@" in parts.netloc:
        raise bad("credentials in the URL are not accepted")
    if parts.fragment or url.endswith("#"):
        raise bad("a fragment is never sent")
    return url


_CREATED: dict[int | str, Any] = {200: {"description": "The endpoint, with its signing secret (shown only here).",
                                       "links": {op: {"operationId": op, "parameters": {
                                           "webhook_id": "$response.body#/id"}}
                                           for op in ("retrieveWebhook", "listWebhookDeliveries", "deleteWebhook")}}}


@router.post("", operation_id="createWebhook", responses=_CREATED | errors(400, 409))
async def create(body: CreateWebhook, svc: ServicesDep, tenant: TenantDep):
    url = check_url(body.url)
    description = check_text(body.description, "description") if body.description is not None else None
    wanted = set(body.events or EVENT_TYPES)
    events = [e for e in EVENT_TYPES if e in wanted]  # in the documented order, once each
    secret = format_secret(secrets.token_bytes(SECRET_BYTES))
    row: dict[str, Any] = dict(id="wh_" + uuid.uuid4().hex[:24], tenant=tenant, url=url, secret=secret,
                               events=events, description=description, created_at=int(time.time()))
    most = svc.settings.max_webhooks_per_tenant
    async with svc.db.begin() as conn:
        if not await webhook_store.create_endpoint(conn, row, most):
            raise APIError(409, f"This tenant has {most} webhooks already, the most it may have; delete one first.",
                           param="url", code="webhook_limit_reached", headers=_NO_RETRY)
    return webhook_object(row, secret)


@router.get("", operation_id="listWebhooks", responses=errors(400))
async def list_(svc: ServicesDep, tenant: TenantDep):
    async with svc.db.connect() as conn:
        rows = await webhook_store.list_endpoints(conn, tenant)
    data = [webhook_object(r) for r in rows]
    return dict(object="list", data=data, first_id=data[0]["id"] if data else None,
                last_id=data[-1]["id"] if data else None, has_more=False)


async def _owned(svc, webhook_id: str, tenant: str) -> dict[str, Any]:
    require_id("webhook", webhook_id, "webhook_id")
    async with svc.db.connect() as conn:
        row = await webhook_store.get_endpoint(conn, webhook_id, tenant)
    if row is None:
        raise not_found("webhook", webhook_id, "webhook_id")
    return row


@router.get("/{webhook_id}", operation_id="retrieveWebhook", responses=errors(404))
async def retrieve(webhook_id: str, svc: ServicesDep, tenant: TenantDep):
    return webhook_object(await _owned(svc, webhook_id, tenant))


@router.delete("/{webhook_id}", operation_id="deleteWebhook", responses=errors(404))
async def delete(webhook_id: str, svc: ServicesDep, tenant: TenantDep):
    """Nothing more is delivered to it, retries of earlier events included; what was
    delivered stays in the journal."""
    require_id("webhook", webhook_id, "webhook_id")
    async with svc.db.begin() as conn:
        if not await webhook_store.delete_endpoint(conn, webhook_id, tenant, int(time.time())):
            raise not_found("webhook", webhook_id, "webhook_id")
    return dict(id=webhook_id, object="webhook.deleted", deleted=True)


@router.get("/{webhook_id}/deliveries", operation_id="listWebhookDeliveries", responses=errors(400, 404))
async def deliveries(webhook_id: str, svc: ServicesDep, tenant: TenantDep, limit: int = Query(20, ge=1, le=100)):
    """The endpoint's most recent events, newest first, with how their delivery went."""
    await _owned(svc, webhook_id, tenant)
    async with svc.db.connect() as conn:
        rows = await webhook_store.deliveries(conn, tenant, webhook_id, limit + 1)
    data = [dict(object="webhook.delivery", event_id=r["event_id"], type=r["type"], created_at=r["created_at"],
                 status=r["status"], attempts=r["attempts"], last_status_code=r["status_code"],
                 last_error=r["error"], last_attempt_at=r["attempted_at"], delivered_at=r["delivered_at"],
                 abandoned=r["abandoned"])
            for r in rows[:limit]]
    return dict(object="list", data=data, has_more=len(rows) > limit)
