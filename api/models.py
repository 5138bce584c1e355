"""/v1/models: the models a caller can call here, in OpenAI's shape.

That is the deployment's own model (`settings.model_name`, listed while its engines start),
every model a serving engine pool announces (policy/pools.py: requests for it are checked,
admitted and routed for that pool), and the tenant's fine-tuned models of those. Nothing
else: a listed model that answers 404 would be a lie, so a pool whose last engine left is
no longer listed. `created` is when this API process started (stable for its life, which is
all a client can rely on), or when the fine-tune finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter

from api.deps import Services, ServicesDep, TenantDep
from api.errors import APIError
from journal import finetune_store
from policy.pools import base_model
from protocol import keys
from protocol.schema import errors

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/models")

OWNER = "ballast"


def model_object(id: str, created: int) -> dict[str, Any]:
    return dict(id=id, object="model", created=created, owned_by=OWNER)


async def fine_tuned(svc: Services, tenant: str, models: dict[str, int]) -> list[dict[str, Any]]:
    """The tenant's fine-tuned models (its jobs that succeeded) of the served models, owned
    by the tenant as OpenAI's are by the organization; `created` when the job finished."""
    try:
        async with svc.db.connect() as conn:
            jobs = await finetune_store.succeeded(conn, tenant)
    except Exception as err:  # Postgres is away: the served models still answer
        log.warning("model list without fine-tuned models: %s", err)
        return []
    return [dict(id=j["fine_tuned_model"], object="model", created=j["finished_at"] or j["created_at"],
                 owned_by=tenant) for j in jobs if base_model(j["fine_tuned_model"], models) is not None]


async def _listed(svc: Services, tenant: str, fine_tunes: bool = True) -> list[dict[str, Any]]:
    models = await svc.models()
    mine = await fine_tuned(svc, tenant, models) if fine_tunes else []
    return [model_object(m, svc.engines.started) for m in models] + mine


@router.get("", operation_id="listModels")
async def list_models(svc: ServicesDep, tenant: TenantDep):
    return dict(object="list", data=await _listed(svc, tenant))


@router.delete("/{model:path}", operation_id="deleteModel", responses=errors(403, 404))
async def delete_model(model: str, svc: ServicesDep, tenant: TenantDep):
    """Delete one of the tenant's fine-tuned models, as OpenAI's API does: no longer listed
    or callable, its adapter and checkpoints removed from the object store. Its job, its
    events and the ledger stay (the audit trail); its result files are the tenant's files."""
    if not keys.is_fine_tuned(model):
        if any(m == model for m in await svc.models()):
            raise APIError(403, f"The model '{model}' is not a fine-tuned model of yours; only those can be deleted.",
                           param="model", code="model_not_deletable")
        raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
    async with svc.db.begin() as conn:
        job = await finetune_store.model_job(conn, tenant, model)
        if job is None:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        objects = [c["object_key"] for c in await finetune_store.checkpoints(conn, job["id"])]
        await finetune_store.delete_model(conn, job, int(time.time()))
    # After the commit: a crash here leaves objects no one can reach (the model is gone),
    # never a listed model without its adapter.
    objects += [f"{keys.adapter(job['id'])}/{name}" for name in keys.ADAPTER_FILES]
    try:
        await asyncio.to_thread(svc.store.delete, objects)
    except OSError as err:
        log.warning("model %s deleted; its objects could not all be removed: %s", model, err)
    return dict(id=model, object="model", deleted=True)


@router.get("/{model:path}", operation_id="retrieveModel", responses=errors(404))
async def retrieve_model(model: str, svc: ServicesDep, tenant: TenantDep):
    for m in await _listed(svc, tenant, fine_tunes=keys.is_fine_tuned(model)):
        if m["id"] == model:
            return m
    raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
