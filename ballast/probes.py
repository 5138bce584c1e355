"""The control worker's own listener: /healthz (the process answers), /readyz (its journal
and Temporal answer, and its workers poll) and /metrics (behind the metrics token), for
orchestrators' probes and Prometheus. The API and the engine workers serve theirs on
their own ports."""

from __future__ import annotations

import asyncio
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
from telemetry import exposition

log = logging.getLogger(__name__)


def probes_app(db: AsyncEngine, client: Client, polling: Callable[[], bool], metrics_token: str | None) -> Starlette:
    """`polling`: whether the process's Temporal workers are running."""

    async def healthz(_: Request) -> Response:
        return JSONResponse(dict(status="ok"))

    async def readyz(_: Request) -> Response:
        parts: dict[str, str] = {}
        try:
            async with asyncio.timeout(3):
                async with db.connect() as conn:
                    await conn.execute(text("SELECT 1"))
            parts["database"] = "ok"
        except Exception as err:  # a probe reports, it does not raise
            parts["database"] = f"down: {type(err).__name__}"
        try:
            async with asyncio.timeout(3):
                await client.service_client.check_health()
            parts["temporal"] = "ok"
        except Exception as err:
            parts["temporal"] = f"down: {type(err).__name__}"
        parts["workers"] = "ok" if polling() else "down: not polling"
        ready = all(v == "ok" for v in parts.values())
        return JSONResponse(dict(status="ok" if ready else "unavailable", parts=parts),
                            status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        ok = exposition.allowed(request.headers.get("authorization"), metrics_token)
        if ok is None:
            return JSONResponse(error_body(404, "Metrics are off: set BALLAST_METRICS_TOKEN.", None, "not_found"),
                                status_code=404)
        if not ok:
            return JSONResponse(error_body(401, "The metrics token is missing or wrong.", None,
                                           "invalid_metrics_token"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return Response(await exposition.render(), media_type=exposition.CONTENT_TYPE)

    return Starlette(routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)])
