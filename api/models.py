"""/v1/models: the models this deployment serves, in OpenAI's shape.

Served models are the deployment's own (`settings.model_name`) and whatever the live
engines report, so an engine pool for another model shows up as soon as it announces
itself. `created` is when this API process first saw the model (its start, for the
deployment's own): stable for the life of the process, which is all a client can rely on.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter

from api.deps import Services, ServicesDep
from api.errors import APIError
from protocol.schema import errors

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/models")

OWNER = "ballast"


def model_object(id: str, created: int) -> dict[str, Any]:
    return dict(id=id, object="model", created=created, owned_by=OWNER)


async def served(svc: Services) -> list[dict[str, Any]]:
    """The deployment's model first, then the other models live engines serve, by name."""
    directory = svc.engines
    try:
        live = {e.model for e in await directory.live()}
    except Exception as err:  # Postgres is away: still answer with what we know for sure
        log.warning("model list without the engine directory: %s", err)
        live = set()
    own = svc.settings.model_name
    others = sorted(live - {own})
    return [model_object(own, directory.started)] + [
        model_object(m, directory.first_seen.get(m, directory.started)) for m in others
    ]


@router.get("", operation_id="listModels")
async def list_models(svc: ServicesDep):
    return dict(object="list", data=await served(svc))


@router.get("/{model:path}", operation_id="retrieveModel", responses=errors(404))
async def retrieve_model(model: str, svc: ServicesDep):
    for m in await served(svc):
        if m["id"] == model:
            return m
    raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
