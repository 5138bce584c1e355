"""What request handlers depend on, injected with `Annotated` (FastAPI's idiom)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any

import httpx
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client
from temporalio.common import TypedSearchAttributes, WorkflowIDReusePolicy

from api.errors import APIError
from api.services.admission import Admission, default_holder
from api.services.auth import KeyCache, authenticate
from api.services.engine_directory import EngineDirectory
from api.services.placer import Placer
from api.services.settlement import Settlement
from config import Settings
from journal.tenant_store import Principal
from policy.pools import embedding_models, served_models
from protocol import search
from protocol.temporal import RequestWindowInput
from storage.objects import ObjectStore
from workflows.interactive import RequestWindowWorkflow


@dataclass
class Services:
    settings: Settings
    db: AsyncEngine
    temporal: Client
    store: ObjectStore
    engines: EngineDirectory
    http: httpx.AsyncClient  # to engine workers' streaming endpoints
    keys: KeyCache  # API key → tenant, bounded-stale (api/services/auth.py)
    admission: Admission | None = None  # limits and the quota ledger (api/services/admission.py); None: admit all
    placer: Placer = field(init=False)  # where requests go (api/services/placer.py)
    settlement: Settlement = field(init=False)  # ended requests, journaled by the window (api/services/settlement.py)
    health: dict[str, Any] = field(default_factory=dict)  # /healthz's one shared check (api/health.py)
    searchable: bool = False  # workflows started here carry search attributes (config.temporal)

    def __post_init__(self) -> None:
        self.placer = Placer(self.settings)
        holder = self.admission.holder if self.admission is not None else default_holder()
        self.settlement = Settlement(self._start_window, holder, window_s=self.settings.settle_window_s,
                                     max_requests=self.settings.settle_window_max)

    async def _start_window(self, workflow_id: str, window: RequestWindowInput) -> None:
        await self.temporal.start_workflow(
            RequestWindowWorkflow.run, window, id=workflow_id, task_queue=self.settings.interactive_queue,
            search_attributes=self.attributes("interactive", ""), rpc_timeout=timedelta(seconds=10),
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )

    def attributes(self, kind: str, tenant: str, model: str = "", tier: str = "") -> TypedSearchAttributes:
        """The search attributes of a workflow started here (none where they are off)."""
        return search.attributes(kind, tenant, model, tier) if self.searchable else TypedSearchAttributes.empty

    async def models(self) -> dict[str, int]:
        """Model → context length, for every model callable here (policy/pools.py)."""
        return served_models(await self.engines.live(), self.settings.model_name, self.settings.max_model_len)

    async def embedding_models(self) -> frozenset[str]:
        """The models that serve embeddings and nothing else (policy/pools.py)."""
        return embedding_models(await self.engines.live(), self.settings.model_name, self.settings.model_task)


# Dependencies are coroutines: FastAPI runs a plain `def` dependency in a worker thread,
# a thread hop (and a GIL hand-off) on every request's path for a dictionary lookup.
async def _services(request: Request) -> Services:
    return request.app.state.services


# -- who is calling: `Authorization: Bearer <key>` -------------------------------------

# For /openapi.json (the security scheme); the key itself is checked by `api.services.auth`.
_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer sk-ballast-…`.")


async def _principal(request: Request,
                     _documented: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]) -> Principal:
    # The Authenticate middleware has checked the key before the body was read; a route
    # it does not cover still gets the same check here.
    found = getattr(request.state, "principal", None)
    if found is None:
        found = await authenticate(request.app.state.services.keys, request.headers.get("authorization"))
    return found


async def _tenant(principal: Annotated[Principal, Depends(_principal)]) -> str:
    if not principal.tenant:
        raise APIError(403, "This key administers Ballast and belongs to no tenant; /v1 needs a tenant's key.",
                       code="tenant_key_required")
    return principal.tenant


async def _admin(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
    if not principal.admin:
        raise APIError(403, "This endpoint needs an admin key.", code="admin_key_required")
    return principal


ServicesDep = Annotated[Services, Depends(_services)]
PrincipalDep = Annotated[Principal, Depends(_principal)]
TenantDep = Annotated[str, Depends(_tenant)]
AdminDep = Annotated[Principal, Depends(_admin)]
# For a router: every route in it needs a tenant's key, whether or not it reads the tenant.
REQUIRE_KEY = Depends(_tenant)
