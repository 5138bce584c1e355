"""/v1/usage/completions and /v1/limits: what a tenant has used, as the audit views count
it, and where it stands against each of its limits now.

The usage endpoint has the shape of OpenAI's organization usage API (time buckets, each
with its results, grouped by model and service tier, paged by `next_page`); its figures
are the ledger's settles, the rows `usage_by_minute|hour|day` sum (in UTC). A tenant's key
sees its own; an admin key sees every tenant's together, or one named by `tenant`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from api.deps import PrincipalDep, ServicesDep
from api.errors import APIError, check_text
from journal import backlog, ledger
from journal.tenant_store import Principal
from protocol.schema import errors

router = APIRouter(prefix="/v1", responses=errors(401))

# OpenAI's bucket widths, with its default and largest page of buckets for each.
WIDTHS: dict[str, tuple[str, int, int, int]] = {"1m": ("minute", 60, 60, 1440), "1h": ("hour", 3600, 24, 168),
                                                "1d": ("day", 86400, 7, 31)}
GROUPS = {"model": "model", "service_tier": "tier"}  # OpenAI's group_by name → the ledger's column


def _scope(who: Principal, tenant: str | None) -> str | None:
    """Whose usage: a tenant's key its own (naming another is refused); an admin key every
    tenant's (None), or the one it names."""
    if who.tenant:
        if tenant is not None and tenant != who.tenant:
            raise APIError(403, "A tenant's key sees its own usage only; leave out `tenant`.", param="tenant",
                           code="tenant_mismatch")
        return who.tenant
    if not who.admin:
        raise APIError(403, "This key belongs to no tenant and is not an admin key.", code="tenant_key_required")
    return check_text(tenant, "tenant") if tenant is not None else None


@router.get("/usage/completions", operation_id="usageCompletions", responses=errors(400, 403))
async def usage_completions(
        svc: ServicesDep, who: PrincipalDep,
        start_time: Annotated[int, Query(ge=0, le=2**40, description="Start of the first bucket (Unix seconds, "
                                                                     "rounded down to the bucket width)")],
        end_time: Annotated[int | None, Query(ge=0, le=2**40)] = None,
        bucket_width: Literal["1m", "1h", "1d"] = "1d",
        group_by: Annotated[list[Literal["model", "service_tier"]] | None, Query()] = None,
        limit: Annotated[int | None, Query(ge=1)] = None,
        page: Annotated[str | None, Query(max_length=20)] = None,
        tenant: Annotated[str | None, Query(max_length=63)] = None):
    """Settled usage per time bucket, oldest first: requests, input and output tokens."""
    scope = _scope(who, tenant)
    unit, width, default, most = WIDTHS[bucket_width]
    if limit is not None and limit > most:
        raise APIError(400, f"limit must be at most {most} for bucket_width {bucket_width}.", param="limit",
                       code="invalid_value")
    if page is not None:  # a `next_page`: where the next bucket starts
        if not page.isdigit():
            raise APIError(400, "page must be a next_page value this endpoint returned.", param="page",
                           code="invalid_value")
        start_time = int(page)
    end = min(end_time if end_time is not None else int(time.time()) + 1, 2**40)
    first = start_time - start_time % width  # UTC buckets: whole minutes, hours, days since the epoch
    if end <= start_time:
        raise APIError(400, "end_time must be after start_time.", param="end_time", code="invalid_value")
    n = min(limit or default, -(-(end - first) // width))
    stop = first + n * width
    by = [GROUPS[g] for g in dict.fromkeys(group_by or [])]
    async with svc.db.connect() as conn:
        rows = await ledger.settled_buckets(conn, scope, unit, first, min(stop, end), by)
    results: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        results.setdefault(r["start"], []).append(dict(
            object="organization.usage.completions.result", input_tokens=int(r["input_tokens"]),
            output_tokens=int(r["output_tokens"]), num_model_requests=int(r["requests"]),
            model=r.get("model"), service_tier=r.get("tier")))
    data = [dict(object="bucket", start_time=t, end_time=t + width, results=results.get(t, []))
            for t in range(first, stop, width)]
    more = stop < end
    return dict(object="page", data=data, has_more=more, next_page=str(stop) if more else None)


@router.get("/limits", operation_id="listLimits", responses=errors(403))
async def list_limits(svc: ServicesDep, who: PrincipalDep, tenant: Annotated[str | None, Query(max_length=63)] = None):
    """Each limit set on the tenant (or, for an admin key, on every tenant or the one named),
    with what counts against it now, counted as admission counts it."""
    scope = _scope(who, tenant)
    async with svc.db.connect() as conn:
        use = await backlog.quota_use(conn, scope)
    return dict(object="list", data=[dict(object="limit", tenant=u.tenant, model=u.model, limit=u.limit,
                                          allowed=u.allowed, used=u.used) for u in use])
