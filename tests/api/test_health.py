"""/healthz costs one check a second however many ask, and tells each caller only what its
key allows."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from api import health
from journal.tenant_store import Principal
from tests.api.conftest import BARE_KEY, Untouchable, build, known_keys


async def test_callers_share_one_check_a_second(settings, monkeypatch):
    calls = 0

    async def parts(svc):
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return dict(postgres="ok", temporal_control_worker="down: RPCError: connect to 10.0.0.7:7233 refused")

    monkeypatch.setattr(health, "_parts", parts)
    monkeypatch.setattr(health, "CACHE_S", 0.3)
    # The cache's clock, moved by hand: 20 requests in flight on a loaded machine may take
    # longer than the cache lasts.
    now = [1000.0]
    monkeypatch.setattr(health, "time", SimpleNamespace(monotonic=lambda: now[0]))
    keys = known_keys({BARE_KEY: Principal("default", "key_bare"), "sk-ballast-" + "a" * 43:
                       Principal("default", "key_admin", admin=True)})
    async with build(settings, Untouchable("postgres"), Untouchable("temporal"), None, keys=keys) as anyone:
        got = await asyncio.gather(*(anyone.get("/healthz") for _ in range(20)))
        assert calls == 1 and {r.status_code for r in got} == {503}
        assert got[0].json() == {"status": "unavailable"}  # anyone: no parts, no addresses
        tenant = (await anyone.get("/healthz", headers={"Authorization": f"Bearer {BARE_KEY}"})).json()
        assert tenant["parts"] == dict(postgres="ok", temporal_control_worker="down")  # which, not why
        admin = (await anyone.get("/healthz", headers={"Authorization": "Bearer sk-ballast-" + "a" * 43})).json()
        assert "10.0.0.7" in admin["parts"]["temporal_control_worker"]
        assert calls == 1
        now[0] += 0.35
        await anyone.get("/healthz")
        assert calls == 2
