"""What request handlers depend on, injected with `Annotated` (FastAPI's idiom)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import httpx
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from api.engines import EngineDirectory
from ballast.settings import Settings
from journal.objects import ObjectStore


@dataclass
class Services:
    settings: Settings
    db: AsyncEngine
    temporal: Client
    store: ObjectStore
    engines: EngineDirectory
    http: httpx.AsyncClient  # to engine workers' streaming endpoints


def _services(request: Request) -> Services:
    return request.app.state.services


def _tenant(request: Request) -> str:
    # One tenant until API keys map to tenants (the quotas work); the key is not checked.
    return "default"


ServicesDep = Annotated[Services, Depends(_services)]
TenantDep = Annotated[str, Depends(_tenant)]
