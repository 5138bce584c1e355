"""The FastAPI application: OpenAI-compatible /v1 plus health."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from temporalio.client import Client
from temporalio.worker import Worker

from activities.requests import RequestActivities
from api import batches, errors, files, health, interactive
from api.deps import Services
from api.engines import EngineDirectory
from ballast.settings import Settings
from journal.db import connect
from journal.objects import ObjectStore
from workflows.interactive import InteractiveWorkflow

# Multipart framing on top of the file itself.
_UPLOAD_SLACK = 64 * 1024


def create_app(settings: Settings, temporal: Client | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        db = connect(settings.database_url)
        client = temporal or await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace)
        http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), limits=httpx.Limits(max_connections=1024))
        directory = EngineDirectory(db)
        following = asyncio.create_task(directory.follow())
        app.state.services = Services(settings, db, client, ObjectStore(settings.object_store_url), directory, http)
        # Interactive request workflows start eagerly here, in this process: no dispatch.
        acts = RequestActivities(db)
        worker = Worker(client, task_queue=settings.interactive_queue, workflows=[InteractiveWorkflow],
                        activities=[acts.journal_request])
        async with worker:
            try:
                yield
            finally:
                following.cancel()
                await http.aclose()
        await db.dispose()

    app = FastAPI(title="Ballast", version="0.1.0", lifespan=lifespan)
    errors.install(app)

    app.add_middleware(RejectOversize, limit=settings.max_upload_bytes)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(interactive.router)
    app.include_router(health.router)
    return app


class RejectOversize:
    """Refuses an oversize upload by its Content-Length, before the multipart parser spools
    it to disk. Plain ASGI: Starlette's BaseHTTPMiddleware would put a task group and a
    memory stream between every streamed token and the client."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.limit + _UPLOAD_SLACK:
                response = errors.error_response(413, files.too_large(self.limit).message, "file", "file_too_large")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
