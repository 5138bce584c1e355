"""/v1/models: the models a caller can call here, in OpenAI's shape.

That is the deployment's own model (`settings.model_name`: the one its requests are checked,
admitted and routed for) and the tenant's fine-tuned models. An engine pool serving another
model does not make that model callable through this API, so it is not listed either: a
listed model that answers 404 would be a lie. `created` is when this API process started
(stable for its life, which is all a client can rely on), or when the fine-tune finished.
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
    return [model_object(svc.settings.model_name, svc.engines.started)]


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
