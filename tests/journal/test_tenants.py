"""Tenants, keys and limits in the journal, as the services' role writes them: only a
key's sha256 is stored (checked against hashlib here), a revoked key is no one's, and
limits are upserted a dimension at a time."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from journal import tenant_store
from journal.schema import api_keys
from protocol.limits import LIMITS


@pytest.fixture
def name() -> str:
    return "t-" + uuid.uuid4().hex[:10]


async def test_a_key_is_stored_as_its_sha256_only(db, name):
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name, weight=2)
        key_id, key = await tenant_store.create_key(conn, name, "ci", admin=False)
    assert key.startswith("sk-ballast-") and len(key) >= 11 + 43  # 32 random bytes, base64url
    async with db.connect() as conn:
        row = (await conn.execute(select(api_keys).where(api_keys.c.id == key_id))).one()._mapping
        dumped = (await conn.execute(text("SELECT row_to_json(k)::text FROM api_keys k WHERE id = :id"),
                                     dict(id=key_id))).scalar_one()
        assert await tenant_store.lookup(conn, key) == tenant_store.Principal(name, key_id, False, 2)
        assert await tenant_store.lookup(conn, key + "x") is None
        assert await tenant_store.lookup(conn, row["hash"]) is None  # the hash is not a key
    assert row["hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert row["prefix"] == key[:len(row["prefix"])] and len(row["prefix"]) <= 16
    assert key not in dumped and key[len(row["prefix"]):] not in dumped  # nowhere in the row


async def test_keys_are_random_and_listed_without_hashes(db, name):
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name)
        made = [await tenant_store.create_key(conn, name, admin=i == 1) for i in range(3)]
        listed = await tenant_store.list_keys(conn, name)
    assert len({k for _, k in made}) == 3 and len({i for i, _ in made}) == 3
    # One transaction, one created_at: the order among these three is their ids'.
    assert [k["id"] for k in listed] == sorted(i for i, _ in made)
    assert {k["id"]: k["admin"] for k in listed} == {i: n == 1 for n, (i, _) in enumerate(made)}
    assert all("hash" not in k for k in listed)


async def test_revoke_is_at_once_and_once(db, name):
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name)
        key_id, key = await tenant_store.create_key(conn, name)
        other_id, other = await tenant_store.create_key(conn, name)
    async with db.begin() as conn:
        first = await tenant_store.revoke(conn, key_id)
        assert first is not None and first["revoked_at"] is not None
        assert first["hash"] == hashlib.sha256(key.encode()).hexdigest()
    async with db.begin() as conn:
        again = await tenant_store.revoke(conn, key_id)
        assert again is not None and again["revoked_at"] == first["revoked_at"]  # the first time stands
        assert await tenant_store.revoke(conn, "key_unknown") is None
        assert await tenant_store.lookup(conn, key) is None
        assert await tenant_store.lookup(conn, other) == tenant_store.Principal(name, other_id, False)


async def test_tiers_are_only_the_grantable_ones_here_and_in_the_database(db, owner_db):
    name = "tiers-" + uuid.uuid4().hex[:8]
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name)
        assert await tenant_store.set_tiers(conn, name, ["priority", "priority"]) == ["priority"]
        with pytest.raises(ValueError, match="Invalid tier"):
            await tenant_store.set_tiers(conn, name, ["batch"])
    with pytest.raises(IntegrityError):
        async with owner_db.begin() as conn:
            await conn.execute(text("UPDATE tenants SET tiers = '{default}' WHERE id = :id"), dict(id=name))


async def test_the_journals_own_tenant_id_is_reserved(db):
    async with db.begin() as conn:
        with pytest.raises(ValueError, match="reserved"):
            await tenant_store.create_tenant(conn, "system")
        with pytest.raises(ValueError, match="reserved"):
            await tenant_store.ensure_tenant(conn, "system")


@pytest.mark.parametrize("bad", ["", "Upper", "-lead", "_lead", "has space", "a" * 64, "ü", "a\x00b", "a/b"])
async def test_tenant_ids_are_checked_here_and_by_the_database(db, owner_db, bad):
    async with db.begin() as conn:
        with pytest.raises(ValueError, match="Invalid tenant id"):
            await tenant_store.create_tenant(conn, bad)
    if "\x00" not in bad:  # Postgres cannot even hold that one
        with pytest.raises(IntegrityError):
            async with owner_db.begin() as conn:
                await conn.execute(text("INSERT INTO tenants (id) VALUES (:id)"), dict(id=bad))


async def test_a_taken_id_is_a_clear_error_and_ensure_is_idempotent(db, name):
    async with db.begin() as conn:
        assert await tenant_store.ensure_tenant(conn, name) is True
        assert await tenant_store.ensure_tenant(conn, name) is False
        with pytest.raises(tenant_store.TenantExists, match="already exists"):
            await tenant_store.create_tenant(conn, name)
        await tenant_store.create_key(conn, name)  # the transaction is still usable
        with pytest.raises(ValueError, match="weight"):
            await tenant_store.create_tenant(conn, name + "-w", weight=0)
    async with db.connect() as conn:
        assert name in [t["id"] for t in await tenant_store.list_tenants(conn)]
        with pytest.raises(tenant_store.UnknownTenant):
            await tenant_store.create_key(conn, name + "-missing")
        with pytest.raises(tenant_store.UnknownTenant):
            await tenant_store.list_keys(conn, name + "-missing")


async def test_limits_upsert_a_dimension_at_a_time(db, name):
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name)
        assert await tenant_store.get_limits(conn, name) == []
        await tenant_store.set_limits(conn, name, requests_per_min=60, tokens_per_day=10_000)
        await tenant_store.set_limits(conn, name, "ballast-tiny", concurrent_requests=2)
        row = await tenant_store.set_limits(conn, name, tokens_per_day=None, output_tokens_per_min=500)
    assert (row["requests_per_min"], row["tokens_per_day"], row["output_tokens_per_min"]) == (60, None, 500)
    async with db.connect() as conn:
        got = await tenant_store.get_limits(conn, name)
    assert [r["model"] for r in got] == ["*", "ballast-tiny"]
    assert {d: got[1][d] for d in LIMITS} == {d: 2 if d == "concurrent_requests" else None
                                                               for d in LIMITS}


@pytest.mark.parametrize("dims, match", [
    (dict(requests_per_minute=1), "Unknown limit"),
    (dict(requests_per_min=-1), "non-negative"),
    (dict(requests_per_min=1.5), "non-negative"),
    (dict(requests_per_min=True), "non-negative"),
])
async def test_bad_limits_are_refused(db, name, dims, match):
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name)
        with pytest.raises(ValueError, match=match):
            await tenant_store.set_limits(conn, name, **dims)
        with pytest.raises(tenant_store.UnknownTenant):
            await tenant_store.set_limits(conn, name + "-missing", requests_per_min=1)


async def test_a_lookup_carries_the_tenants_weight_for_its_fair_share(db, name):
    async with db.begin() as c:
        await tenant_store.create_tenant(c, name, weight=3)
        _, key = await tenant_store.create_key(c, name)
    async with db.connect() as c:
        weight = (await c.execute(text("SELECT weight FROM tenants WHERE id = :t"), dict(t=name))).scalar()
        found = await tenant_store.lookup(c, key)
    assert found is not None and found.tenant == name and found.weight == weight == 3
