"""Tenants, their API keys and their limits: what the admin API and `ballast tenants` do.

A key is `sk-ballast-` and 256 random bits. Only its sha256 is stored (with its first
characters, to recognise it in a list): a key that random cannot be guessed from its hash,
so a slow password hash (bcrypt, argon2) would only cost every request a few milliseconds
for nothing. Looking a key up is one indexed equality on the hash.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.schema import api_keys, limits, tenants
from protocol.limits import ANY_MODEL, LIMITS
from protocol.tiers import GRANTED

KEY_PREFIX = "sk-ballast-"
KEY_FORMAT = re.compile(r"sk-ballast-[A-Za-z0-9_-]{43}")  # KEY_PREFIX and token_urlsafe(32)
SHOWN = 14  # characters of a key kept for display: "sk-ballast-" and 3 random ones
TENANT_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")  # as the tenants_id_format constraint
# What the journal writes as the tenant of its own events (the fleet controller's): no
# caller's tenant may be mistaken for it.
SYSTEM = "system"
RESERVED_TENANTS = frozenset({SYSTEM})


@dataclass(frozen=True)
class Principal:
    """Who a request is from: the tenant its key belongs to ("": an admin key of no tenant),
    and whether it may administer."""

    tenant: str
    key_id: str
    admin: bool = False
    weight: int = 1  # the tenant's fair-share weight, as of the lookup (cached with the key)
    regions: frozenset[str] | None = None  # where its work may run; None: anywhere
    tiers: frozenset[str] = frozenset()  # the tiers of protocol.tiers.GRANTED it was granted


class TenantExists(ValueError):
    pass


class UnknownTenant(LookupError):
    pass


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8", "surrogatepass")).hexdigest()


def check_tenant_id(id: str) -> str:
    if not isinstance(id, str) or not TENANT_ID.fullmatch(id):
        raise ValueError(f"Invalid tenant id {id!r}: 1 to 63 characters, lowercase letters, digits, '-' and '_', "
                         "starting with a letter or digit.")
    if id in RESERVED_TENANTS:
        raise ValueError(f"Invalid tenant id {id!r}: reserved for Ballast's own records.")
    return id


# -- tenants --------------------------------------------------------------------------


async def create_tenant(conn: AsyncConnection, id: str, weight: int = 1) -> dict[str, Any]:
    """The new tenant's row; TenantExists if the id is taken (ValueError if it cannot be one)."""
    row = await _insert_tenant(conn, id, weight)
    if row is None:
        raise TenantExists(f"Tenant {id!r} already exists.")
    return row


async def ensure_tenant(conn: AsyncConnection, id: str, weight: int = 1) -> bool:
    """Create the tenant unless it exists; whether this call created it."""
    return await _insert_tenant(conn, id, weight) is not None


async def _insert_tenant(conn: AsyncConnection, id: str, weight: int) -> dict[str, Any] | None:
    check_tenant_id(id)
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ValueError(f"Invalid weight {weight!r}: a positive integer.")
    # ON CONFLICT, not a caught IntegrityError: the caller's transaction stays usable.
    stmt = insert(tenants).values(id=id, weight=weight).on_conflict_do_nothing(index_elements=[tenants.c.id])
    row = (await conn.execute(stmt.returning(*tenants.c))).first()
    return dict(row._mapping) if row else None


async def get_tenant(conn: AsyncConnection, id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(tenants).where(tenants.c.id == id))).first()
    return dict(row._mapping) if row else None


async def set_regions(conn: AsyncConnection, id: str, regions: list[str] | None) -> None:
    """Fence the tenant's work to these regions (None: anywhere)."""
    await _require_tenant(conn, id)
    await conn.execute(tenants.update().where(tenants.c.id == id).values(regions=regions))


async def set_tiers(conn: AsyncConnection, id: str, tiers: Iterable[str]) -> list[str]:
    """Grant the tenant exactly these tiers (of GRANTED); the tiers it has now, sorted."""
    granted = sorted(set(tiers))
    if unknown := [t for t in granted if t not in GRANTED]:
        raise ValueError(f"Invalid tier {unknown[0]!r}: the tiers a tenant is granted are "
                         f"{', '.join(sorted(GRANTED))} (the others are open to every tenant).")
    await _require_tenant(conn, id)
    await conn.execute(tenants.update().where(tenants.c.id == id).values(tiers=granted))
    return granted


async def list_tenants(conn: AsyncConnection) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in (await conn.execute(select(tenants).order_by(tenants.c.id))).all()]


async def _require_tenant(conn: AsyncConnection, id: str) -> None:
    if not TENANT_ID.fullmatch(id) or await get_tenant(conn, id) is None:
        raise UnknownTenant(f"No tenant {id!r}.")


# -- keys -----------------------------------------------------------------------------


def well_formed(key: str) -> bool:
    """Whether `key` could be one `create_key` made: anything else is refused without a query."""
    return KEY_FORMAT.fullmatch(key) is not None


async def create_key(conn: AsyncConnection, tenant: str | None, name: str | None = None,
                     admin: bool = False) -> tuple[str, str]:
    """(key id, the key itself): the only time the key is seen; only its hash is kept.
    `tenant` None: an admin key of no tenant (it administers, and has no /v1)."""
    if tenant is None:
        if not admin:
            raise ValueError("a key of no tenant is an admin key")
    else:
        await _require_tenant(conn, tenant)
    key_id = "key_" + secrets.token_hex(12)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    await conn.execute(api_keys.insert().values(id=key_id, tenant=tenant, hash=hash_key(plaintext),
                                                prefix=plaintext[:SHOWN], name=name, admin=admin))
    return key_id, plaintext


async def lookup(conn: AsyncConnection, plaintext: str) -> Principal | None:
    """The key's principal; None for a key that is unknown or revoked."""
    q = (select(api_keys.c.id, api_keys.c.tenant, api_keys.c.admin, tenants.c.weight, tenants.c.regions,
                tenants.c.tiers)
         .outerjoin(tenants, tenants.c.id == api_keys.c.tenant)
         .where(api_keys.c.hash == hash_key(plaintext), api_keys.c.revoked_at.is_(None)))
    row = (await conn.execute(q)).first()
    if row is None:
        return None
    if row.tenant is None:  # an admin of no tenant
        return Principal("", row.id, True)
    regions = frozenset(row.regions) if row.regions is not None else None
    return Principal(row.tenant, row.id, row.admin, row.weight, regions, frozenset(row.tiers))


_SHOWN_COLUMNS = [c for c in api_keys.c if c.name != "hash"]


async def list_keys(conn: AsyncConnection, tenant: str | None) -> list[dict[str, Any]]:
    """The tenant's keys (None: the admin keys of no tenant), revoked ones too, oldest
    first; never their hashes."""
    where: ColumnElement[bool]
    if tenant is None:
        where = api_keys.c.tenant.is_(None)
    else:
        await _require_tenant(conn, tenant)
        where = api_keys.c.tenant == tenant
    q = select(*_SHOWN_COLUMNS).where(where).order_by(api_keys.c.created_at, api_keys.c.id)
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def get_key(conn: AsyncConnection, key_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(*_SHOWN_COLUMNS).where(api_keys.c.id == key_id))).first()
    return dict(row._mapping) if row else None


async def revoke(conn: AsyncConnection, key_id: str) -> dict[str, Any] | None:
    """Revoke the key (again: a no-op that keeps the first time); its row with its hash, so
    a caller can drop it from a cache at once; None if there is no such key."""
    await conn.execute(api_keys.update().where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                       .values(revoked_at=func.now()))
    row = (await conn.execute(select(api_keys).where(api_keys.c.id == key_id))).first()
    return dict(row._mapping) if row else None


# -- limits ---------------------------------------------------------------------------


async def get_limits(conn: AsyncConnection, tenant: str) -> list[dict[str, Any]]:
    """The tenant's limits, one row per model ('*' first); a NULL dimension is unlimited."""
    await _require_tenant(conn, tenant)
    q = select(limits).where(limits.c.tenant == tenant).order_by(limits.c.model != ANY_MODEL, limits.c.model)
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def set_limits(conn: AsyncConnection, tenant: str, model: str = ANY_MODEL, **dims: int | None) -> dict[str, Any]:
    """Upsert the tenant's limits for `model`: each dimension given is set (None clears it,
    no limit), the others stay as they are. Returns the row."""
    unknown = set(dims) - set(LIMITS)
    if unknown:
        raise ValueError(f"Unknown limit {sorted(unknown)[0]!r}; limits are {', '.join(LIMITS)}.")
    for k, v in dims.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"Invalid {k} {v!r}: a non-negative integer, or None for no limit.")
    if not isinstance(model, str) or not model or "\x00" in model:
        raise ValueError(f"Invalid model {model!r}.")
    await _require_tenant(conn, tenant)
    stmt = insert(limits).values(tenant=tenant, model=model, **dims)
    stmt = stmt.on_conflict_do_update(index_elements=[limits.c.tenant, limits.c.model],
                                      set_=dict(dims, updated_at=func.now()))
    row = (await conn.execute(stmt.returning(*limits.c))).one()
    return dict(row._mapping)
