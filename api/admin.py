"""/admin: tenants, their API keys, limits, tiers, regions and reserved capacity, and the
erasure of their content; the admin keys; the engine workers (list, drain, undrain). Every route needs
an admin key. An admin key belongs to no tenant (it administers, and has no /v1 of its own);
one made before that rule keeps its tenant until revoked.

A key's plaintext is in the answer that creates it and nowhere else, ever: lists show its
id, its first characters and its name. Revoking a key takes effect at once on this API
process and within BALLAST_KEY_CACHE_S on every other.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncConnection

from api.deps import AdminDep, Services, ServicesDep
from api.errors import APIError, check_text, not_found, possible_id
from journal import engine_registry, erasure, reservations, tenant_store
from protocol.engine_wire import EngineStats
from protocol.limits import ANY_MODEL, LIMITS
from protocol.schema import errors
from protocol.tiers import GRANTED

router = APIRouter(prefix="/admin", tags=["admin"], responses=errors(401, 403))

_LIMIT = Field(default=None, ge=0, le=2**63 - 1)


class CreateTenant(BaseModel):
    id: str = Field(max_length=63)
    weight: int = Field(default=1, ge=1, le=1_000_000)
    tiers: list[str] = Field(default_factory=list, max_length=8)  # granted: `priority` runs ahead of the others


class Tiers(BaseModel):
    """The tiers the tenant is granted, replaced whole ([]: none; the open tiers need no grant)."""

    tiers: list[str] = Field(max_length=8)


class Regions(BaseModel):
    """Where the tenant's work may run: only engine workers in these regions (their
    BALLAST_REGION); null: anywhere."""

    regions: list[str] | None = Field(max_length=64)


class CreateKey(BaseModel):
    name: str | None = Field(default=None, max_length=200)
    admin: bool = False  # refused: an admin key belongs to no tenant (POST /admin/keys)


class CreateAdminKey(BaseModel):
    name: str | None = Field(default=None, max_length=200)


class Limits(BaseModel):
    """The tenant's limits for `model` ('*': every model), replaced whole: an absent or
    null dimension is no limit."""

    model: str = Field(default=ANY_MODEL, min_length=1, max_length=256)
    requests_per_min: int | None = _LIMIT
    input_tokens_per_min: int | None = _LIMIT
    output_tokens_per_min: int | None = _LIMIT
    concurrent_requests: int | None = _LIMIT
    tokens_per_day: int | None = _LIMIT
    batch_queue_tokens: int | None = _LIMIT
    concurrent_fine_tunes: int | None = _LIMIT


class Reservation(BaseModel):
    """Sequence slots of `model`'s pool kept for the tenant, spread over its engine workers,
    or output tokens a second there, kept as the slots that give them at the pool's
    measured rate with every slot busy: one of the two (0: none). What the tenant does not
    use is lent to batch work, which yields it back."""

    model: str = Field(min_length=1, max_length=256)
    slots: int | None = Field(default=None, ge=0, le=1_000_000)
    tokens_per_s: int | None = Field(default=None, ge=0, le=1_000_000_000)
    # Kept on that region's engine workers of the pool alone ("": anywhere in the pool).
    region: str = Field(default="", max_length=64)


def _epoch(at: datetime | None) -> int | None:
    return int(at.timestamp()) if at is not None else None


def tenant_object(row: dict[str, Any]) -> dict[str, Any]:
    return dict(id=row["id"], object="tenant", weight=row["weight"], tiers=sorted(row["tiers"]),
                regions=row.get("regions"), created_at=_epoch(row["created_at"]))


def key_object(row: dict[str, Any], plaintext: str | None = None) -> dict[str, Any]:
    out = dict(id=row["id"], object="api_key", tenant=row["tenant"], prefix=row["prefix"], name=row["name"],
               admin=row["admin"], created_at=_epoch(row["created_at"]), revoked_at=_epoch(row["revoked_at"]))
    return out | dict(key=plaintext) if plaintext is not None else out


def limits_object(row: dict[str, Any]) -> dict[str, Any]:
    return dict(tenant=row["tenant"], model=row["model"], **{d: row[d] for d in LIMITS},
                updated_at=_epoch(row["updated_at"]))


def _unknown(tenant: str) -> APIError:
    return not_found("tenant", tenant, "tenant_id")


async def _new_key(conn: AsyncConnection, tenant: str | None, name: str | None, admin: bool) -> dict[str, Any]:
    key_id, plaintext = await tenant_store.create_key(conn, tenant, name, admin)
    row = await tenant_store.get_key(conn, key_id)
    assert row is not None
    return key_object(row, plaintext)


@router.post("/tenants", operation_id="createTenant", responses=errors(400, 409))
async def create_tenant(body: CreateTenant, svc: ServicesDep, _: AdminDep):
    """A tenant and its first key (shown once)."""
    try:
        tenant_store.check_tenant_id(body.id)
    except ValueError as err:
        raise APIError(400, str(err), param="id", code="invalid_value") from None
    _check_tiers(body.tiers)
    async with svc.db.begin() as conn:
        try:
            row = await tenant_store.create_tenant(conn, body.id, body.weight)
        except tenant_store.TenantExists as err:
            raise APIError(409, str(err), param="id", code="tenant_exists") from None
        if svc.settings.new_tenant_limits:  # bounded from the start; PUT .../limits changes them
            await tenant_store.set_limits(conn, body.id, ANY_MODEL, **svc.settings.new_tenant_limits)
        row["tiers"] = await tenant_store.set_tiers(conn, body.id, body.tiers)
        key = await _new_key(conn, body.id, None, False)
    return dict(tenant=tenant_object(row), key=key)


def _check_tiers(tiers: list[str]) -> None:
    if unknown := [t for t in tiers if t not in GRANTED]:
        raise APIError(400, f"Invalid tier {check_text(unknown[0], 'tiers')!r}: a tenant is granted "
                            f"{', '.join(sorted(GRANTED))}; the other tiers are open to every tenant.",
                       param="tiers", code="invalid_value")


@router.put("/tenants/{tenant_id}/tiers", operation_id="setTenantTiers", responses=errors(400, 404))
async def set_tiers(tenant_id: str, body: Tiers, svc: ServicesDep, _: AdminDep):
    """Grant the tenant these tiers; its keys carry them within BALLAST_KEY_CACHE_S."""
    _check_tiers(body.tiers)
    async with svc.db.begin() as conn:
        try:
            await tenant_store.set_tiers(conn, tenant_id, body.tiers)
        except tenant_store.UnknownTenant:
            raise _unknown(tenant_id) from None
        row = await tenant_store.get_tenant(conn, tenant_id)
    assert row is not None
    return tenant_object(row)


@router.put("/tenants/{tenant_id}/regions", operation_id="setTenantRegions", responses=errors(400, 404))
async def set_regions(tenant_id: str, body: Regions, svc: ServicesDep, _: AdminDep):
    """Fence the tenant's work to these regions (null lifts the fence); its keys carry it
    within BALLAST_KEY_CACHE_S, and its batches created from then on run there."""
    regions = None
    if body.regions is not None:
        regions = sorted({check_text(r.strip(), "regions") for r in body.regions if r.strip()})
        if not regions:
            raise APIError(400, "A fence needs at least one region; null lifts it.", param="regions",
                           code="invalid_value")
    async with svc.db.begin() as conn:
        if await tenant_store.get_tenant(conn, tenant_id) is None:
            raise _unknown(tenant_id)
        await tenant_store.set_regions(conn, tenant_id, regions)
        row = await tenant_store.get_tenant(conn, tenant_id)
    assert row is not None
    return tenant_object(row)


@router.post("/tenants/{tenant_id}/erase", operation_id="eraseTenantContent", responses=errors(404, 409))
async def erase(tenant_id: str, svc: ServicesDep, who: AdminDep):
    """Erase the tenant's content: its files, checkpoints and adapters (its fine-tuned models
    are deleted), and the requests, generated tokens, responses, filenames and metadata its
    journal events carry. Every event, its counts and usage, and the ledger stay (the audit
    trail), with one `content_erased` event that records this. Refused (409) while a batch
    or fine-tuning job of the tenant is still running. Repeatable: a second call erases what
    came since."""
    async with svc.db.connect() as conn:
        if await tenant_store.get_tenant(conn, tenant_id) is None:
            raise _unknown(tenant_id)
    try:
        done = await erasure.erase_tenant_content(svc.db, svc.store, tenant_id, who.key_id)
    except erasure.StillRunning as err:
        raise APIError(409, f"Tenant {tenant_id} still has work running, which needs its content: "
                            f"{', '.join(err.running[:10])}{' …' if len(err.running) > 10 else ''}. Cancel it "
                            "(POST /v1/batches/{id}/cancel, /v1/fine_tuning/jobs/{id}/cancel), wait for it to end, "
                            "and erase again.", param="tenant_id", code="tenant_busy") from None
    return dict(object="tenant.erasure", **asdict(done))


@router.get("/tenants", operation_id="listTenants", responses=errors())
async def list_tenants(svc: ServicesDep, _: AdminDep):
    async with svc.db.connect() as conn:
        rows = await tenant_store.list_tenants(conn)
    return dict(object="list", data=[tenant_object(r) for r in rows])


@router.post("/tenants/{tenant_id}/keys", operation_id="createKey", responses=errors(400, 404))
async def create_key(tenant_id: str, svc: ServicesDep, _: AdminDep, body: CreateKey | None = None):
    body = body or CreateKey()
    if body.name is not None:
        check_text(body.name, "name")
    if body.admin:
        raise APIError(400, "An admin key belongs to no tenant, so that it never doubles as a tenant's /v1 key: "
                            "make one with POST /admin/keys.", param="admin", code="invalid_value")
    async with svc.db.begin() as conn:
        try:
            return await _new_key(conn, tenant_id, body.name, False)
        except tenant_store.UnknownTenant:
            raise _unknown(tenant_id) from None


@router.post("/keys", operation_id="createAdminKey", responses=errors(400))
async def create_admin_key(svc: ServicesDep, _: AdminDep, body: CreateAdminKey | None = None):
    """An admin key of no tenant (shown once)."""
    body = body or CreateAdminKey()
    if body.name is not None:
        check_text(body.name, "name")
    async with svc.db.begin() as conn:
        return await _new_key(conn, None, body.name, True)


@router.get("/keys", operation_id="listAdminKeys", responses=errors())
async def list_admin_keys(svc: ServicesDep, _: AdminDep):
    """The admin keys of no tenant, revoked ones too."""
    async with svc.db.connect() as conn:
        rows = await tenant_store.list_keys(conn, None)
    return dict(object="list", data=[key_object(r) for r in rows])


@router.get("/tenants/{tenant_id}/keys", operation_id="listKeys", responses=errors(404))
async def list_keys(tenant_id: str, svc: ServicesDep, _: AdminDep):
    async with svc.db.connect() as conn:
        try:
            rows = await tenant_store.list_keys(conn, tenant_id)
        except tenant_store.UnknownTenant:
            raise _unknown(tenant_id) from None
    return dict(object="list", data=[key_object(r) for r in rows])


@router.post("/keys/{key_id}/revoke", operation_id="revokeKey", responses=errors(404))
async def revoke_key(key_id: str, svc: ServicesDep, _: AdminDep):
    row = None
    if possible_id(key_id):  # one that cannot be an id is unknown without asking Postgres
        async with svc.db.begin() as conn:
            row = await tenant_store.revoke(conn, key_id)
    if row is None:
        raise not_found("API key", key_id, "key_id")
    svc.keys.forget(row["hash"])  # at once here; other API processes within their cache's bound
    return key_object(row)


@router.get("/tenants/{tenant_id}/limits", operation_id="getLimits", responses=errors(404))
async def get_limits(tenant_id: str, svc: ServicesDep, _: AdminDep):
    async with svc.db.connect() as conn:
        try:
            rows = await tenant_store.get_limits(conn, tenant_id)
        except tenant_store.UnknownTenant:
            raise _unknown(tenant_id) from None
    return dict(object="list", data=[limits_object(r) for r in rows])


@router.put("/tenants/{tenant_id}/limits", operation_id="setLimits", responses=errors(400, 404))
async def set_limits(tenant_id: str, body: Limits, svc: ServicesDep, _: AdminDep):
    check_text(body.model, "model")
    async with svc.db.begin() as conn:
        try:
            row = await tenant_store.set_limits(conn, tenant_id, body.model, **body.model_dump(exclude={"model"}))
        except tenant_store.UnknownTenant:
            raise _unknown(tenant_id) from None
    return limits_object(row)


# -- reserved capacity -----------------------------------------------------------------


def reservation_object(row: dict[str, Any], engines: list[EngineStats] | None = None) -> dict[str, Any]:
    region = row.get("region", "")
    tokens_per_s = row.get("tokens_per_s", 0)
    out = dict(object="reservation", tenant=row["tenant"], model=row["model"], region=region or None,
               slots=None if tokens_per_s else row["slots"], tokens_per_s=tokens_per_s or None,
               set_at=row.get("set_at", row.get("at")))
    if engines is not None:  # as its pool's engine workers (of its region) last said: kept for it, held by it
        here = [e for e in engines if not region or e.region == region]
        out.update(on_engines=sum(e.reserved.get(row["tenant"], 0) for e in here),
                   used=sum(e.reserved_used.get(row["tenant"], 0) for e in here))
    return out


@router.put("/tenants/{tenant_id}/reservations", operation_id="setReservation", responses=errors(400, 404))
async def set_reservation(tenant_id: str, body: Reservation, svc: ServicesDep, admin: AdminDep):
    check_text(body.model, "model")
    check_text(body.region, "region")
    if body.model == ANY_MODEL:
        raise APIError(400, "A reservation is on one model's pool: name the model.", param="model",
                       code="invalid_value")
    if (body.slots is None) == (body.tokens_per_s is None):
        raise APIError(400, "A reservation is in sequence slots or in output tokens a second: give `slots` or "
                       "`tokens_per_s`, not both (0 withdraws it).", param="slots", code="invalid_value")
    async with svc.db.begin() as conn:
        if await tenant_store.get_tenant(conn, tenant_id) is None:
            raise _unknown(tenant_id)
        change = await reservations.set_reservation(conn, tenant_id, body.model, body.slots or 0, admin.key_id,
                                                    body.region, tokens_per_s=body.tokens_per_s or 0)
    return reservation_object(change)


@router.get("/tenants/{tenant_id}/reservations", operation_id="getReservations", responses=errors(404))
async def get_reservations(tenant_id: str, svc: ServicesDep, _: AdminDep):
    """The tenant's reservations in force, and every change to them, oldest first."""
    async with svc.db.connect() as conn:
        if await tenant_store.get_tenant(conn, tenant_id) is None:
            raise _unknown(tenant_id)
        rows = await reservations.in_force(conn, tenant=tenant_id)
        changes = await reservations.history(conn, tenant_id)
    return dict(object="list", data=[reservation_object(r) for r in rows],
                history=[dict(reservation_object(c), by=c["by"]) for c in changes])


@router.get("/reservations", operation_id="listReservations", responses=errors())
async def list_reservations(svc: ServicesDep, _: AdminDep):
    """Every reservation in force with what its pool's engine workers keep and its requests
    use now; per pool, the reserved slots batch holds meanwhile (lent)."""
    async with svc.db.connect() as conn:
        rows = await reservations.in_force(conn)
        live = [e for e in await engine_registry.live(conn, LISTED_WITHIN_S) if not e["draining"]]
    pools: dict[str, list[EngineStats]] = {}
    for e in live:
        pools.setdefault(e["model"], []).append(EngineStats.from_json(e["stats"]))
    return dict(object="list", data=[reservation_object(r, pools.get(r["model"], [])) for r in rows],
                lent={m: sum(e.lent for e in es) for m, es in sorted(pools.items())})


# -- engine workers ---------------------------------------------------------------------

_ENGINE_ID = re.compile(r"[A-Za-z0-9._-]{1,256}")  # host name and process id: anything else is unknown
LISTED_WITHIN_S = 60.0  # an engine silent longer has left (as `ballast worker list` shows them)


def engine_object(row: dict[str, Any]) -> dict[str, Any]:
    st = EngineStats.from_json(row["stats"])
    return dict(id=row["id"], object="engine", model=row["model"], region=st.region, url=row["url"],
                state="draining" if row["draining"] else "serving", running=st.running, waiting=st.waiting,
                kv_cache_usage=st.kv_cache_usage, interactive=st.interactive, batch=st.batch,
                batch_queued=st.batch_queued, max_seqs=st.max_seqs, batch_cap=row["batch_cap"],
                stats=row["stats"], seen_at=_epoch(row["seen_at"]))


@router.get("/engines", operation_id="listEngines", responses=errors())
async def list_engines(svc: ServicesDep, _: AdminDep):
    """The engine workers that announced themselves in the last minute, with their load."""
    async with svc.db.connect() as conn:
        rows = await engine_registry.live(conn, within_s=LISTED_WITHIN_S)
    return dict(object="list", data=[engine_object(r) for r in rows])


async def _drain(svc: Services, engine_id: str, draining: bool) -> dict[str, Any]:
    async with svc.db.begin() as conn:
        if not _ENGINE_ID.fullmatch(engine_id) or not await engine_registry.drain(conn, engine_id, draining):
            raise not_found("engine worker", engine_id, "engine_id")
        rows = [r for r in await engine_registry.live(conn, within_s=1e9) if r["id"] == engine_id]
    return engine_object(rows[0])


@router.post("/engines/{engine_id}/drain", operation_id="drainEngine", responses=errors(404))
async def drain_engine(engine_id: str, svc: ServicesDep, _: AdminDep):
    """The engine worker takes no new work from its next announcement (about a second): the
    API sends it no new requests and it stops polling for batch work; its generations finish
    or move to the others, resuming from the journal."""
    return await _drain(svc, engine_id, True)


@router.post("/engines/{engine_id}/undrain", operation_id="undrainEngine", responses=errors(404))
async def undrain_engine(engine_id: str, svc: ServicesDep, _: AdminDep):
    """The engine worker takes new work again."""
    return await _drain(svc, engine_id, False)
