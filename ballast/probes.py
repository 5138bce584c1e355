"""The control worker's own listener: /healthz (the process answers), /readyz (its journal
and Temporal answer, and its workers poll) and /metrics (behind the metrics token), for
orchestrators' probes and Prometheus. The API and the engine workers serve theirs on
their own ports."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client

from protocol.errors import error_body
from telemetry import exposition, health

log = logging.getLogger(__name__)


def probes_app(db: AsyncEngine, client: Client, polling: Callable[[], bool], metrics_token: str | None) -> Starlette:
    """`polling`: whether the process's Temporal workers are running."""

    async def healthz(_: Request) -> Response:
        return JSONResponse(dict(status="ok"))

    async def database() -> None:
        async with db.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def readyz(_: Request) -> Response:
        body, status = health.readiness(dict(database=await health.part(database()),
                                             temporal=await health.part(client.service_client.check_health()),
                                             workers="ok" if polling() else "down: not polling"))
        return JSONResponse(body, status_code=status)

    async def metrics(request: Request) -> Response:
        if no := exposition.refusal(request.headers.get("authorization"), metrics_token):
            return JSONResponse(error_body(no.status, no.message, None, no.code), status_code=no.status,
                                headers=no.headers)
        return Response(await exposition.render(), media_type=exposition.CONTENT_TYPE)

    return Starlette(routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)])
