"""The keys `ballast up` keeps for tenant `default`: made on first start (0600 files),
reused while they work, replaced when they do not (revoked, or another database)."""

from __future__ import annotations

import asyncio
import stat

import pytest

from ballast import stack
from journal import tenant_store
from journal.db import connect


def _keys(db_url, data_dir):
    # Sync, as `ballast up` calls it; in a thread since pytest's loop runs here.
    return asyncio.to_thread(lambda: asyncio.run(stack._keys(db_url, data_dir)))


async def _principal(db_url, key):
    db = connect(db_url, pool_size=1)
    try:
        async with db.connect() as conn:
            return await tenant_store.lookup(conn, key)
    finally:
        await db.dispose()


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path


async def test_made_once_then_reused_and_replaced_when_revoked(db_url, data_dir):
    first = await _keys(db_url, data_dir)
    assert [(k.path.name, k.admin, k.new) for k in first] == [("api-key", False, True), ("admin-key", True, True)]
    for k in first:
        assert stat.S_IMODE(k.path.stat().st_mode) == 0o600
        assert k.path.read_text().strip() == k.key
        p = await _principal(db_url, k.key)
        # The working key is the tenant's; the admin key belongs to no tenant.
        assert p is not None and p.tenant == ("" if k.admin else "default") and p.admin == k.admin

    again = await _keys(db_url, data_dir)
    assert [(k.key, k.new) for k in again] == [(k.key, False) for k in first]

    db = connect(db_url, pool_size=1)
    try:
        async with db.begin() as conn:
            await tenant_store.revoke(conn, (await tenant_store.lookup(conn, first[0].key)).key_id)
    finally:
        await db.dispose()
    third = await _keys(db_url, data_dir)
    assert third[0].new and third[0].key != first[0].key and not third[1].new
    assert (data_dir / "api-key").read_text().strip() == third[0].key


def test_the_engine_token_is_made_once_and_kept_0600(data_dir, monkeypatch):
    """Unless BALLAST_ENGINE_TOKEN is set, `ballast up` makes the engine token once, in
    data_dir/engine-token, and reuses it (engine workers on other hosts were given it)."""
    from config import Settings

    monkeypatch.delenv("BALLAST_ENGINE_TOKEN", raising=False)
    token = stack.engine_token(Settings(_env_file=None), data_dir)
    path = data_dir / stack.ENGINE_TOKEN_FILE
    assert len(token) >= 40 and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stack.engine_token(Settings(_env_file=None), data_dir) == token
    other = data_dir / "other"
    other.mkdir()
    assert stack.engine_token(Settings(_env_file=None), other) != token  # random, not derived

    monkeypatch.setenv("BALLAST_ENGINE_TOKEN", "set-by-the-operator")
    assert stack.engine_token(Settings(_env_file=None), data_dir) == "set-by-the-operator"
    assert path.read_text().strip() == token  # the file is left alone
