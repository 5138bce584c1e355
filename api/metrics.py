"""GET /metrics: this API process's series in Prometheus' text format (telemetry/), for
whoever presents the metrics token (BALLAST_METRICS_TOKEN); 404 where none is set. Not in
the OpenAPI document: it is for Prometheus, not for clients."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.deps import ServicesDep
from api.errors import APIError
from telemetry import exposition

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, svc: ServicesDep) -> Response:
    token = svc.settings.metrics_token
    if no := exposition.refusal(request.headers.get("authorization"), token.get_secret_value() if token else None):
        raise APIError(no.status, no.message, code=no.code,
                       headers=no.headers)
    return Response(await exposition.render(), media_type=exposition.CONTENT_TYPE)
