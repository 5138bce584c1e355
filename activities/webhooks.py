"""Completion webhooks' side effects, on the control worker (its webhook queue): raise a
job's terminal event, POST it to one endpoint, give up on one.

`raise_webhook` journals the event once per (job, terminal status) with the endpoints of
the tenant subscribed to it at that moment, reading the status from the journal (what the
job reached, whatever its workflow believed); nothing is raised where no endpoint listens.
`deliver_webhook` is one attempt: the exact body bytes it signs are the bytes it sends,
it follows no redirect, it connects only to an address it has checked against the denied
networks, and it journals what came back before it returns (a 2xx) or fails (anything
else: Temporal retries it by the plan's policy). A retry after a lost 2xx sends the event
again under the same `webhook-id`: delivery is at least once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio import activity
from temporalio.exceptions import ApplicationError

from config.webhooks import WebhookSettings
from journal import batch_store, finetune_store, webhook_store
from protocol import keys
from protocol.temporal import AbandonInput, DeliverInput, WebhookInput, WebhookPlan
from protocol.webhooks import (
    WebhookAbandoned,
    WebhookAttempt,
    WebhookEvent,
    delivered,
    event_id,
    event_type,
    signed_headers,
)

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
NOT_DELIVERED = "WebhookNotDelivered"  # the ApplicationError type of a failed attempt (retried)
ERROR_CHARS = 500


class Refused(Exception):
    """The endpoint's address is one deliveries may not reach."""


def denied_networks(spec: str) -> list[IPNetwork]:
    return [ipaddress.ip_network(n.strip(), strict=False) for n in spec.split(",") if n.strip()]


def is_denied(addr: IPAddress, networks: list[IPNetwork]) -> bool:
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return any(a in net for a in (addr, mapped) if a is not None for net in networks)


async def pinned(url: str, networks: list[IPNetwork]) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Where to send a POST to `url`: the URL with its host replaced by an address it
    resolves to, having checked every such address; with the Host header and the TLS
    server name of the original, so the receiver and its certificate see the name. A
    rebinding DNS answer cannot send the request elsewhere after the check."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addrs: list[IPAddress] = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            raise Refused(f"{host} could not be resolved: {err}") from err
        addrs = [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos]
    if not addrs:
        raise Refused(f"{host} resolves to no address")
    for addr in addrs:
        if is_denied(addr, networks):
            raise Refused(f"{host} resolves to {addr}, in a network webhooks may not reach")
    ip = addrs[0]
    netloc = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    extensions: dict[str, Any] = {"sni_hostname": host} if parts.scheme == "https" else {}
    return target, {"host": parts.netloc}, extensions


class WebhookActivities:
    def __init__(self, db: AsyncEngine, settings: WebhookSettings):
        self.db = db
        self.settings = settings
        self.networks = denied_networks(settings.webhook_denied_networks)
        # One connection per attempt (no keep-alive): each is made to the address just
        # checked, with the TLS name of its own endpoint.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(settings.webhook_timeout_s), follow_redirects=False,
                                      trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))

    async def close(self) -> None:
        await self.http.aclose()

    def _plan(self, event: WebhookEvent | None) -> WebhookPlan:
        s = self.settings
        return WebhookPlan(event.id if event else "", list(event.endpoints) if event else [],
                           s.webhook_retry_initial_s, s.webhook_retry_max_interval_s, s.webhook_give_up_after_s,
                           s.webhook_timeout_s)

    @activity.defn
    async def raise_webhook(self, inp: WebhookInput) -> WebhookPlan:
        async with self.db.begin() as conn:
            ended = await _ended(conn, inp)
            if ended is None:
                return self._plan(None)
            tenant, stream, status, at = ended
            kind = event_type(inp.kind, status)
            if kind is None:  # not an end (the workflow stopped short of one): nothing to say
                activity.logger.warning("%s is %s: no webhook event to raise", stream, status)
                return self._plan(None)
            eid = event_id(stream, status)
            found = await webhook_store.raised(conn, eid)
            if found is not None:
                return self._plan(found[0])
            endpoints = await webhook_store.subscribers(conn, tenant, kind)
            if not endpoints:
                return self._plan(None)
            event = await webhook_store.raise_event(conn, tenant, stream, status,
                                                    WebhookEvent(eid, kind, at, inp.job_id, endpoints))
        activity.logger.info("webhook %s: %s for %d endpoints", event.id, event.type, len(event.endpoints))
        return self._plan(event)

    @activity.defn
    async def deliver_webhook(self, inp: DeliverInput) -> bool:
        """One attempt; True once delivered, False where the endpoint is gone; raises to be retried."""
        info = activity.info()
        async with self.db.connect() as conn:
            found = await webhook_store.raised(conn, inp.event_id)
            endpoint = await webhook_store.signing_endpoint(conn, inp.endpoint_id)
        if found is None:
            raise ApplicationError(f"webhook event {inp.event_id} was never raised", non_retryable=True)
        event, tenant = found
        if endpoint is None or endpoint["deleted_at"] is not None or endpoint["tenant"] != tenant:
            async with self.db.begin() as conn:
                await webhook_store.abandon(conn, tenant, WebhookAbandoned(event.id, inp.endpoint_id,
                                                                           "endpoint_deleted"))
            return False
        body = event.body()
        at = int(time.time())
        headers = signed_headers(endpoint["secret"], event.id, at, body)
        code: int | None = None
        error: str | None = None
        t0 = time.monotonic()
        try:
            target, host, extensions = await pinned(endpoint["url"], self.networks)
            async with asyncio.timeout(self.settings.webhook_timeout_s):
                # Streamed and closed unread: what the receiver answers beyond its status is
                # not ours to hold.
                async with self.http.stream("POST", target, content=body, headers={**headers, **host},
                                            extensions=extensions) as r:
                    code = r.status_code
        except Refused as err:
            error = str(err)
        except TimeoutError:
            error = f"no response within {self.settings.webhook_timeout_s:g} s"
        except httpx.HTTPError as err:
            error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        ok = delivered(code)
        if code is not None and not ok:
            error = f"HTTP {code}" + (" (redirects are not followed)" if 300 <= code < 400 else "")
        attempt = WebhookAttempt(event.id, inp.endpoint_id, info.attempt, at, code,
                                 None if ok else (error or "failed")[:ERROR_CHARS], ok,
                                 int((time.monotonic() - t0) * 1000))
        async with self.db.begin() as conn:
            await webhook_store.record_attempt(conn, tenant, attempt, info.workflow_run_id or "")
        if not ok:
            activity.logger.info("webhook %s to %s, attempt %d: %s", event.id, inp.endpoint_id, info.attempt,
                                 attempt.error)
            raise ApplicationError(f"not delivered: {attempt.error}", type=NOT_DELIVERED)
        return True

    @activity.defn
    async def abandon_webhook(self, inp: AbandonInput) -> None:
        async with self.db.begin() as conn:
            found = await webhook_store.raised(conn, inp.event_id)
            if found is None:
                return
            await webhook_store.abandon(conn, found[1], WebhookAbandoned(inp.event_id, inp.endpoint_id, inp.reason,
                                                                         inp.detail[:ERROR_CHARS]))
        activity.logger.warning("webhook %s to %s abandoned: %s %s", inp.event_id, inp.endpoint_id, inp.reason,
                                inp.detail)


async def _ended(conn: AsyncConnection, inp: WebhookInput) -> tuple[str, str, str, int] | None:
    """(tenant, stream, status, when it reached it) of the job; None if it does not exist."""
    if inp.kind == "batch":
        batch = await batch_store.get_batch(conn, inp.job_id)
        if batch is None:
            return None
        at = batch.get(f"{batch['status']}_at")
        return batch["tenant"], keys.batch(inp.job_id), batch["status"], int(at or time.time())
    job = await finetune_store.get_job(conn, inp.job_id)
    if job is None:
        return None
    return job["tenant"], keys.ftjob(inp.job_id), job["status"], int(job["finished_at"] or time.time())
