"""Reserved capacity over the admin API: an admin grants, changes and withdraws a tenant's
slots on a model's pool; every change stays in the journal (its history), the one in force
is the `reservations` row, and the live view adds up what the pool's engine workers say
they keep and what the tenant's requests hold. Bad input gets a 4xx in OpenAI's shape and
changes nothing. Checked against SQL over the journal and rows the test wrote itself."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import text

from journal import tenant_store
from protocol.engine_wire import EngineStats
from tests.api.conftest import assert_openai_error


@pytest.fixture
async def gold(db):
    name = f"gold-{uuid.uuid4().hex[:8]}"
    async with db.begin() as conn:
        await tenant_store.create_tenant(conn, name)
    return name


async def test_an_admin_grants_changes_and_withdraws_a_reservation_with_its_history(admin, gold, owner):
    model = f"pool-{uuid.uuid4().hex[:6]}"
    for slots in (4, 6, 0, 2):
        r = await admin.put(f"/admin/tenants/{gold}/reservations", json=dict(model=model, slots=slots))
        assert r.status_code == 200, r.text
        assert (r.json()["tenant"], r.json()["model"], r.json()["slots"]) == (gold, model, slots)
    got = (await admin.get(f"/admin/tenants/{gold}/reservations")).json()
    assert [(d["model"], d["slots"]) for d in got["data"]] == [(model, 2)]
    assert [c["slots"] for c in got["history"]] == [4, 6, 0, 2] and all(c["by"] for c in got["history"])
    async with owner.connect() as conn:
        journaled = (await conn.execute(text(
            "SELECT payload->>'slots' FROM events WHERE type = 'reservation_set' AND tenant = :t ORDER BY position"),
            dict(t=gold))).scalars().all()
        row = (await conn.execute(text("SELECT slots FROM reservations WHERE tenant = :t AND model = :m"),
                                  dict(t=gold, m=model))).scalars().all()
    assert journaled == ["4", "6", "0", "2"] and row == [2]
    await admin.put(f"/admin/tenants/{gold}/reservations", json=dict(model=model, slots=0))
    assert (await admin.get(f"/admin/tenants/{gold}/reservations")).json()["data"] == []


async def test_a_regional_reservation_stands_beside_the_pools_own(admin, gold, owner):
    model = f"pool-{uuid.uuid4().hex[:6]}"
    for body in (dict(slots=3), dict(slots=2, region="eu-west"), dict(slots=1, region="us-east"),
                 dict(slots=0, region="us-east")):
        r = await admin.put(f"/admin/tenants/{gold}/reservations", json=dict(model=model, **body))
        assert r.status_code == 200 and r.json()["region"] == body.get("region"), r.text
    got = (await admin.get(f"/admin/tenants/{gold}/reservations")).json()
    assert [(d["region"], d["slots"]) for d in got["data"]] == [(None, 3), ("eu-west", 2)]
    assert [(c["region"], c["slots"]) for c in got["history"]] == [(None, 3), ("eu-west", 2), ("us-east", 1),
                                                                   ("us-east", 0)]
    async with owner.connect() as conn:
        rows = (await conn.execute(text("SELECT region, slots FROM reservations WHERE tenant = :t ORDER BY region"),
                                   dict(t=gold))).all()
    assert [tuple(r) for r in rows] == [("", 3), ("eu-west", 2)]


async def test_a_reservation_in_tokens_a_second_replaces_one_in_slots_with_its_history(admin, gold, owner):
    model = f"pool-{uuid.uuid4().hex[:6]}"
    # Withdrawn (either 0), it reads as 0 slots.
    for body, shown in ((dict(slots=2), (2, None)), (dict(tokens_per_s=400), (None, 400)),
                        (dict(tokens_per_s=0), (0, None))):
        r = await admin.put(f"/admin/tenants/{gold}/reservations", json=dict(model=model, **body))
        assert r.status_code == 200, r.text
        assert (r.json()["slots"], r.json()["tokens_per_s"]) == shown
        if shown == (None, 400):
            got = (await admin.get(f"/admin/tenants/{gold}/reservations")).json()
            assert [(d["slots"], d["tokens_per_s"]) for d in got["data"]] == [(None, 400)]
            async with owner.connect() as conn:
                row = (await conn.execute(text("SELECT slots, tokens_per_s FROM reservations WHERE tenant = :t"),
                                          dict(t=gold))).all()
            assert [tuple(x) for x in row] == [(0, 400)]
    got = (await admin.get(f"/admin/tenants/{gold}/reservations")).json()
    assert got["data"] == []
    assert [(c["slots"], c["tokens_per_s"]) for c in got["history"]] == [(2, None), (None, 400), (0, None)]
    async with owner.connect() as conn:
        journaled = (await conn.execute(text(
            "SELECT payload->>'slots', payload->>'tokens_per_s' FROM events WHERE type = 'reservation_set' "
            "AND tenant = :t ORDER BY position"), dict(t=gold))).all()
    assert [tuple(x) for x in journaled] == [("2", "0"), ("0", "400"), ("0", "0")]


@pytest.mark.parametrize("body, param", [
    (dict(model="m", slots=1, region="eu\x00"), "region"),
    (dict(model="m", slots=1, region="r" * 65), "region"),
    (dict(model="*", slots=1), "model"),
    (dict(model="m", slots=-1), "slots"),
    (dict(model="", slots=1), "model"),
    (dict(slots=1), "model"),
    (dict(model="m", slots="many"), "slots"),
    (dict(model="m"), "slots"),
    (dict(model="m", slots=1, tokens_per_s=100), "slots"),
    (dict(model="m", tokens_per_s=-5), "tokens_per_s"),
    (dict(model="m", tokens_per_s=1.5), "tokens_per_s"),
    (dict(model="m\x00", slots=1), "model"),
])
async def test_bad_reservations_are_a_400_and_change_nothing(admin, gold, owner, body, param):
    r = await admin.put(f"/admin/tenants/{gold}/reservations", json=body)
    assert_openai_error(r, 400, param=param)
    async with owner.connect() as conn:
        n = (await conn.execute(text("SELECT count(*) FROM events WHERE type = 'reservation_set' AND tenant = :t"),
                                dict(t=gold))).scalar_one()
    assert n == 0


async def test_an_unknown_tenant_is_a_404(admin):
    r = await admin.put("/admin/tenants/nobody-here/reservations", json=dict(model="m", slots=1))
    assert_openai_error(r, 404, param="tenant_id")
    assert_openai_error(await admin.get("/admin/tenants/nobody-here/reservations"), 404, param="tenant_id")


async def test_the_live_view_adds_up_what_the_pools_engines_keep_and_use(admin, gold, owner):
    model = f"pool-{uuid.uuid4().hex[:6]}"
    await admin.put(f"/admin/tenants/{gold}/reservations", json=dict(model=model, slots=5))
    ids = [f"e-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    said = [EngineStats(reserved={gold: 3}, reserved_used={gold: 1}, lent=2),
            EngineStats(reserved={gold: 2}, reserved_used={gold: 2}, lent=0)]
    async with owner.begin() as conn:
        for engine_id, stats in zip(ids, said, strict=True):
            await conn.execute(text("INSERT INTO engines (id, url, model, queue, stats) VALUES "
                                    "(:id, 'http://10.0.0.9:8000', :m, 'q', CAST(:s AS jsonb))"),
                               dict(id=engine_id, m=model, s=json.dumps(stats.to_json())))
    try:
        got = (await admin.get("/admin/reservations")).json()
        mine = [d for d in got["data"] if d["tenant"] == gold]
        assert [(d["slots"], d["on_engines"], d["used"]) for d in mine] == [(5, 5, 3)]
        assert got["lent"][model] == 2
    finally:
        async with owner.begin() as conn:
            await conn.execute(text("DELETE FROM engines WHERE id = ANY(:ids)"), dict(ids=ids))
