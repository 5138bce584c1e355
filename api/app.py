"""The FastAPI application: OpenAI-compatible /v1 plus health and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from temporalio.client import Client

from api import (
    admin,
    batches,
    embeddings,
    errors,
    files,
    fine_tuning,
    health,
    interactive,
    metrics,
    models,
    usage,
    webhooks,
)
from api.console import router as console_router
from api.deps import REQUIRE_KEY, Services
from api.ratelimit_headers import RateLimitHeaders
from api.request_ids import RequestId
from api.services.admission import Admission
from api.services.auth import Authenticate, KeyCache
from api.services.engine_directory import EngineDirectory
from config import Settings
from config.temporal import connect_temporal, search_attributes_usable
from journal.db import connect
from protocol import schema
from storage.objects import ObjectStore
from telemetry import exposition, families

# Multipart framing on top of the file itself.
UPLOAD_SLACK = 64 * 1024


def create_app(settings: Settings, temporal: Client | None = None, *,
               on_ready: Callable[[], None] = lambda: None) -> FastAPI:
    """`on_ready` runs once the app serves: how a supervised process says so."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        db = connect(settings.require("service_db_url"), name="ballast-api")
        client = temporal or await connect_temporal(settings, exposition.temporal_runtime())
        families.bound_tenants(settings.metrics_max_tenants)
        http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), limits=httpx.Limits(max_connections=1024))
        directory = EngineDirectory(db)
        following = asyncio.create_task(directory.follow())
        admission = await Admission(db, settings).start()  # limits and the quota ledger
        app.state.services = Services(settings, db, client, ObjectStore(settings.object_store_url), directory, http,
                                      keys=KeyCache.over(db, settings.key_cache_s), admission=admission,
                                      searchable=await search_attributes_usable(client, settings))
        # The tokenizer's load starts now (and again once an engine has built the model's
        # files), off the request path.
        app.state.services.placer.tokenizer()
        directory.on_refresh = app.state.services.placer.engines_seen
        directory.me = app.state.services.placer.me
        # No Temporal worker here: the windows' workflows run on the control worker, so
        # bookkeeping never competes with the next request's first token in this process.
        settlement = app.state.services.settlement.start()
        on_ready()
        try:
            yield
        finally:
            following.cancel()
            await http.aclose()
        await settlement.stop()  # the requests that ended since the last window are journaled
        await admission.stop()  # what is still unwritten reaches the ledger
        await db.dispose()

    docs = settings.api_docs  # off: the schema and its pages would map the admin API for anyone
    app = FastAPI(title="Ballast", version="0.1.0", lifespan=lifespan, openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    errors.install(app)

    app.add_middleware(LimitBody, upload_limit=settings.max_upload_bytes, request_limit=settings.max_request_bytes,
                       read_timeout_s=settings.request_read_timeout_s)
    app.add_middleware(RateLimitHeaders)  # x-ratelimit-*: inside Authenticate, whose principal it reads
    app.add_middleware(Authenticate)  # no body is read for a caller without a key
    if settings.admin_port is not None:
        app.add_middleware(AdminListener, port=settings.admin_port)  # before any key is asked
    app.add_middleware(RequestId)  # outermost: every response carries its id, refusals included
    # Every /v1 route needs a tenant's key; /healthz (and the docs, where served) stay open.
    for v1 in (files, batches, fine_tuning, interactive, embeddings, models, webhooks):
        app.include_router(v1.router, dependencies=[REQUIRE_KEY], responses=schema.errors(401))
    app.include_router(usage.router)  # a tenant's key or an admin key
    app.include_router(admin.router)
    app.include_router(console_router)  # /console and /admin/timeline (api/console.py)
    app.include_router(health.router)
    app.include_router(metrics.router)
    return app


class AdminListener:
    """/admin only on the admin listener (`port`), and on it nothing else but what serves an
    admin key and a tenant's alike (BOTH: /healthz, the console, usage and limits): a
    request on the wrong listener is answered as a route that does not exist. Plain ASGI,
    as LimitBody."""

    BOTH = ("/healthz", "/console", "/console/", "/v1/usage/completions", "/v1/limits")

    def __init__(self, app, port: int):
        self.app, self.port = app, port

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            on_admin = (scope.get("server") or (None, None))[1] == self.port
            admin = (scope["path"] + "/").startswith("/admin/")
            path = scope["path"]
            both = path in self.BOTH or path.startswith("/console/")
            if admin != on_admin and not both:
                response = errors.error_response(404, f"No route {scope['path']} here.", None, "not_found")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


class LimitBody:
    """Caps every request body while it is read: an upload (`POST /v1/files`) at
    `upload_limit` plus multipart framing, anything else at `request_limit`.

    A Content-Length over the cap is refused before a byte is read. Every body is counted
    as `receive()` hands it over, and the request is answered 413 the moment the count passes
    the cap; the rest is never buffered. A Content-Length within the cap is not trusted: sent
    beside `Transfer-Encoding: chunked`, the server (h11) reads the chunks, however many.
    Whatever the app made of the cut-off (a parse error, a 500) is replaced by the 413,
    unless it had already begun a response, which cannot be taken back. Only a multipart
    upload gets the upload's allowance: a form-urlencoded or JSON body to the same path is
    parsed in memory, and gets what any request gets.

    A body that stops arriving for `read_timeout_s` (a client trickling bytes to hold a
    connection and the memory of what it sent so far) is answered 408 the same way.

    Plain ASGI: Starlette's BaseHTTPMiddleware would put a task group and a memory stream
    between every streamed token and the client."""

    def __init__(self, app, upload_limit: int, request_limit: int, read_timeout_s: float | None = None):
        self.app, self.upload_limit, self.request_limit = app, upload_limit, request_limit
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        upload = (scope["method"] == "POST" and scope["path"].rstrip("/") == "/v1/files"
                  and headers.get(b"content-type", b"").lower().startswith(b"multipart/form-data"))
        limit = self.upload_limit + UPLOAD_SLACK if upload else self.request_limit
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(upload, scope, receive, send)

        received, over, slow, started, reading = 0, False, False, False, True

        async def counted():
            nonlocal received, over, slow, reading
            if over or slow:
                raise _TooLarge
            if reading and self.read_timeout_s:  # not once the body is in: then it waits for a disconnect
                try:
                    message = await asyncio.wait_for(receive(), self.read_timeout_s)
                except TimeoutError:
                    slow = True
                    raise _TooSlow from None
            else:
                message = await receive()
            if message["type"] == "http.request":
                reading = message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    raise _TooLarge
            return message

        async def guarded(message):
            nonlocal started
            if (over or slow) and not started:
                return  # the app's answer to a cut-off body: ours replaces it
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not (over or slow) or started:
                raise
        if slow and not started:
            late = errors.error_response(408, f"The request body did not arrive: nothing came for "
                                              f"{self.read_timeout_s:g} s.", None, "request_timeout")
            await late(scope, receive, send)
        elif over and not started:
            await self._refuse(upload, scope, receive, send)

    async def _refuse(self, upload: bool, scope, receive, send):
        if upload:
            response = errors.error_response(413, files.too_large(self.upload_limit).message, "file", "file_too_large")
        else:
            response = errors.error_response(
                413, f"The request body exceeds the maximum size of {self.request_limit} bytes.", None,
                "request_too_large")
        await response(scope, receive, send)
