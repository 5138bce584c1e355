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

from api.deps import Services, ServicesDep, TenantDep
from api.errors import APIError
from journal import finetune_store
from protocol import keys
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


async def fine_tuned(svc: Services, tenant: str) -> list[dict[str, Any]]:
    """The tenant's fine-tuned models (its jobs that succeeded), owned by the tenant as
    OpenAI's are by the organization; `created` when the job finished."""
    try:
        async with svc.db.connect() as conn:
            jobs = await finetune_store.succeeded(conn, tenant)
    except Exception as err:  # Postgres is away: the served models still answer
        log.warning("model list without fine-tuned models: %s", err)
        return []
    return [dict(id=j["fine_tuned_model"], object="model", created=j["finished_at"] or j["created_at"],
                 owned_by=tenant) for j in jobs]


@router.get("", operation_id="listModels")
async def list_models(svc: ServicesDep, tenant: TenantDep):
    return dict(object="list", data=await served(svc) + await fine_tuned(svc, tenant))


@router.get("/{model:path}", operation_id="retrieveModel", responses=errors(404))
async def retrieve_model(model: str, svc: ServicesDep, tenant: TenantDep):
    mine = await fine_tuned(svc, tenant) if keys.is_fine_tuned(model) else []
    for m in await served(svc) + mine:
        if m["id"] == model:
            return m
    raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
