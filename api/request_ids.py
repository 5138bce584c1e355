"""x-request-id: the one id a request is known by everywhere. The client's own where it
sends a usable one (up to 128 of A-Z a-z 0-9 . _ : -), else one made here (`req_` and 32
hex digits, the shape of OpenAI's); returned on every response, errors and refusals
included, as OpenAI's API does; logged on the access line, handed to the engine worker
with an interactive request and journaled with its outcome (`http_request_id`).

Where traces are on (telemetry/tracing.py), each request is also a SERVER span, named by its
method and route ("POST /v1/chat/completions"), continuing the client's `traceparent` where it
sends one and carrying the id as `ballast.request_id`; current while the request runs, so the
engine worker's span joins it (and its window's journaling links to it). Probes and scrapes are not traced."""

from __future__ import annotations

import logging
import re
import time
import uuid

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, StatusCode
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telemetry import tracing

HEADER = "x-request-id"
_USABLE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
access = logging.getLogger("ballast.access")
# Probes and scrapes: a trace each, every few seconds, would bury the requests' own.
UNTRACED = frozenset({"/healthz", "/metrics"})


def request_id(conn: HTTPConnection) -> str | None:
    return getattr(conn.state, "request_id", None)


class RequestId:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == HEADER.encode()), None)
        rid = given.decode() if given is not None and _USABLE.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        t0, status = time.perf_counter(), 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message, headers=[*message.get("headers", []), (HEADER.encode(), rid.encode())])
            await send(message)

        span = INVALID_SPAN if scope["path"] in UNTRACED else tracing.server_span(
            scope["method"], Headers(raw=scope["headers"]),
            {"http.request.method": scope["method"], "url.path": scope["path"], "ballast.request_id": rid})
        try:
            with trace.use_span(span):
                await self.app(scope, receive, send_with_id)
        finally:
            ms = round(1000 * (time.perf_counter() - t0), 1)
            access.info("%s %s %s %d %.1fms", rid, scope["method"], scope["path"], status, ms,
                        extra=dict(request_id=rid, method=scope["method"], path=scope["path"], status=status,
                                   duration_ms=ms))
            _ended(span, scope, status)


def _ended(span: Span, scope: Scope, status: int) -> None:
    if not span.is_recording():
        return
    # Named by the route's template once routing found one: /v1/batches/{batch_id}, never an id.
    if (route := getattr(scope.get("route"), "path", None)) is not None:
        span.update_name(f"{scope['method']} {route}")
        span.set_attribute("http.route", route)
    if status:
        span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(StatusCode.ERROR)
    span.end()
