"""The quota ledger: idempotent rows, append-only by the database itself, a fold that an
independent SQL query agrees with, and expiry of a dead holder's reservations."""

import asyncio
import json
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.quota import QuotaActivities
from config.database import libpq_url
from journal import fold, ledger
from journal.events import NewEvent, append
from journal.leases import acquire_many
from journal.ledger import Entry
from protocol import keys
from protocol.temporal import ReconcileInput
from tests.helpers import uid


def reserve(subject: str, tenant: str, i: int, o: int, *, model: str = "m", tier: str = "default",
            holder: str | None = "h-live", at=None) -> Entry:
    return Entry(ledger.RESERVE, subject, tenant, model, tier, i, o, holder, at)


async def rows(db, subject: str) -> list[tuple]:
    async with db.connect() as c:
        q = text("SELECT kind, input_tokens, output_tokens FROM ledger WHERE subject = :s ORDER BY position")
        return [tuple(r) for r in (await c.execute(q, dict(s=subject))).all()]


async def test_reserve_and_settle_are_idempotent_and_the_settle_closes_the_reservation(db):
    t, s = uid("t"), keys.request(uid("r"))
    r = reserve(s, t, 100, 50)
    used = Entry(ledger.SETTLE, s, t, "m", "default", 80, 20, "h-live")
    for _ in range(2):  # a retried flusher, a retried journaling activity
        async with db.begin() as c:
            await ledger.insert(c, [r])
        async with db.begin() as c:
            await ledger.settle(c, used, r)
    assert await rows(db, s) == [("reserve", 100, 50), ("settle", 80, 20)]
    async with db.begin() as c:  # settled: nothing left to refund
        assert not await ledger.refund(c, s)
    assert len(await rows(db, s)) == 2


async def test_what_a_settle_releases_is_refunded_in_the_audit_view_as_a_refund_row_said(db):
    """The same reservations closed as the ledger closes them now (the settle alone, a
    whole refund where nothing settled) and as journals before it did (a refund row of
    what each held beyond its settle): `reserved_vs_settled` gives both the same
    figures, worked out here by hand. A reservation written as an estimate, settled for
    more output than it held, released only what it over-held (its input)."""
    new, old = uid("t"), uid("t")
    closed = [((40, 200), (12, 250), (28, 0)), ((10, 100), (10, 7), (0, 93)), ((5, 5), None, (5, 5))]
    for tenant in (new, old):
        for held, used, back in closed:
            s = keys.request(uid("r"))
            async with db.begin() as c:
                await ledger.insert(c, [reserve(s, tenant, *held)])
            async with db.begin() as c:
                if used is None:
                    assert await ledger.refund(c, s)
                    continue
                await ledger.settle(c, Entry(ledger.SETTLE, s, tenant, "m", "default", *used), reserve(s, tenant, 1, 1))
                if tenant == old:
                    await ledger.insert(c, [Entry(ledger.REFUND, s, tenant, "m", "default", *back, "h-live")])
    async with db.connect() as c:
        got = {r.tenant: (r.reserved, r.settled, r.refunded, r.expired) for r in (await c.execute(text(
            "SELECT * FROM reserved_vs_settled WHERE tenant = ANY(:t)"), dict(t=[new, old]))).all()}
    assert got == {new: (360, 279, 28 + 93 + 10, None), old: (360, 279, 131, None)}
    assert [k for k, *_ in await rows(db, s)] == ["reserve", "refund"]


async def test_a_settle_without_a_reservation_writes_one_first(db):
    t, s = uid("t"), keys.request(uid("r"))
    async with db.begin() as c:
        await ledger.settle(c, Entry(ledger.SETTLE, s, t, "m", "flex", 5, 5), reserve(s, t, 5, 5))
    assert await rows(db, s) == [("reserve", 5, 5), ("settle", 5, 5)]


async def test_two_writers_of_the_same_reservations_in_opposite_orders_do_not_deadlock(db):
    """The API's flusher and a request's journaling both write its reservation, each in
    its own order. One holds the first key (uncommitted) while the other writes both,
    second key first: without one order for every writer the other would hold the second
    and wait on the first, the first then wait on it, and Postgres would abort one."""
    t = uid("t")
    first, second = (reserve(keys.request(uid(f"r{i}")), t, 10, 10) for i in range(2))
    if first.subject > second.subject:
        first, second = second, first
    async with db.connect() as a, db.connect() as b:
        await a.begin()
        assert await ledger.insert(a, [first]) == [first.key]

        async def other() -> list[str]:
            await b.begin()
            written = await ledger.insert(b, [second, first])
            await b.commit()
            return written

        writing = asyncio.create_task(other())
        await asyncio.sleep(0.5)  # it waits on the first key; it must not hold the second
        assert not writing.done()
        assert await asyncio.wait_for(ledger.insert(a, [second]), 10) == [second.key]
        await a.commit()
        assert await asyncio.wait_for(writing, 10) == []  # both written already: the first row stands
    assert await rows(db, first.subject) == await rows(db, second.subject) == [("reserve", 10, 10)]


async def test_a_batch_refund_releases_its_reservation_once(db):
    t, s = uid("t"), keys.batch(uid("batch"))
    async with db.begin() as c:
        await ledger.insert(c, [reserve(s, t, 1000, 500, tier="batch", holder=None)])
        assert await ledger.open_batch_tokens(c, t) == {"m": 1500}
    for expected in (True, False):
        async with db.begin() as c:
            assert await ledger.refund(c, s) is expected
    async with db.connect() as c:
        assert await ledger.open_batch_tokens(c, t) == {}
    assert await rows(db, s) == [("reserve", 1000, 500), ("refund", 1000, 500)]


async def test_an_item_result_settles_the_item_in_its_own_transaction(db):
    t, batch_id = uid("t"), uid("batch")
    body = dict(model="m", usage=dict(prompt_tokens=7, completion_tokens=9, total_tokens=16))
    async with db.begin() as c:
        fences = await acquire_many(c, [f"item:{batch_id}:0", f"item:{batch_id}:1"], "test")
    done = NewEvent(f"item:{batch_id}:0", "item_completed", dict(batch_id=batch_id, idx=0, body_json=json.dumps(body)),
                    f"item:{batch_id}:0:result", t, fence=fences[f"item:{batch_id}:0"])
    failed = NewEvent(f"item:{batch_id}:1", "item_failed",
                      dict(batch_id=batch_id, idx=1, status_code=400, body_json=json.dumps({"error": {}})),
                      f"item:{batch_id}:1:result", t, fence=fences[f"item:{batch_id}:1"])
    for _ in range(2):
        async with db.begin() as c:
            await append(c, [done, failed])
    assert await rows(db, keys.item(batch_id, 0)) == [("settle", 7, 9)]
    assert await rows(db, keys.item(batch_id, 1)) == [("settle", 0, 0)]


@pytest.mark.parametrize("sql", ["UPDATE ledger SET input_tokens = 0", "DELETE FROM ledger", "TRUNCATE ledger"])
def test_the_ledger_is_append_only_for_services_and_owner_alike(service_db_url, db_url, sql):
    with psycopg.connect(libpq_url(service_db_url)) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(sql)
    with psycopg.connect(libpq_url(db_url)) as conn:  # the owner: the trigger refuses
        conn.execute("INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, "
                     "idempotency_key) VALUES ('t', 'm', 'default', 's', 'reserve', 1, 1, %s)", (uid("k"),))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only: .* on ledger"):
            conn.execute(sql)


# What the fold must say, written independently: correlated subqueries per reservation
# instead of the fold's joins and FILTERs.
_STANDS = """
  CASE WHEN EXISTS (SELECT FROM ledger s WHERE s.subject = r.subject AND s.kind = 'settle')
       THEN (SELECT s.{col} FROM ledger s WHERE s.subject = r.subject AND s.kind = 'settle')
       WHEN EXISTS (SELECT FROM ledger x WHERE x.subject = r.subject AND x.kind IN ('refund', 'expire')) THEN 0
       ELSE r.{col} END
"""
_OPEN = "NOT EXISTS (SELECT FROM ledger x WHERE x.subject = r.subject AND x.kind <> 'reserve')"
EXPECTED_MINUTES = f"""
  SELECT r.tenant, r.model, coalesce(r.holder, ''), date_trunc('minute', r.at, 'UTC'), count(*),
         sum({_STANDS.format(col='input_tokens')}), sum({_STANDS.format(col='output_tokens')})
    FROM ledger r
   WHERE r.kind = 'reserve' AND r.tier <> 'batch' AND r.tenant = ANY(:tenants)
     AND r.at >= date_trunc('minute', now(), 'UTC') - interval '1 minute'
   GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
"""
EXPECTED_DAYS = f"""
  SELECT g.tenant, g.model, g.holder,
         (SELECT count(*) FROM ledger r WHERE r.kind = 'reserve' AND r.tier <> 'batch' AND r.tenant = g.tenant
             AND r.model = g.model AND coalesce(r.holder, '') = g.holder AND r.at >= date_trunc('day', now(), 'UTC')),
         (SELECT coalesce(sum({_STANDS.format(col='input_tokens')}), 0) FROM ledger r
           WHERE r.kind = 'reserve' AND r.tier <> 'batch' AND r.tenant = g.tenant AND r.model = g.model
             AND coalesce(r.holder, '') = g.holder AND r.at >= date_trunc('day', now(), 'UTC')),
         (SELECT coalesce(sum({_STANDS.format(col='output_tokens')}), 0) FROM ledger r
           WHERE r.kind = 'reserve' AND r.tier <> 'batch' AND r.tenant = g.tenant AND r.model = g.model
             AND coalesce(r.holder, '') = g.holder AND r.at >= date_trunc('day', now(), 'UTC')),
         (SELECT count(*) FROM ledger r WHERE r.kind = 'reserve' AND r.tier <> 'batch' AND r.tenant = g.tenant
             AND r.model = g.model AND coalesce(r.holder, '') = g.holder AND {_OPEN}),
         (SELECT coalesce(sum(r.input_tokens + r.output_tokens), 0) FROM ledger r
           WHERE r.kind = 'reserve' AND r.tier = 'batch' AND r.tenant = g.tenant AND r.model = g.model
             AND coalesce(r.holder, '') = g.holder AND {_OPEN})
    FROM (SELECT DISTINCT r.tenant, r.model, coalesce(r.holder, '') AS holder FROM ledger r
           WHERE r.kind = 'reserve' AND r.tenant = ANY(:tenants)
             AND (r.at >= date_trunc('day', now(), 'UTC') OR {_OPEN})) g
   ORDER BY 1, 2, 3
"""


async def test_the_fold_agrees_with_an_independent_query(db):
    a, b = uid("ta"), uid("tb")
    async with db.connect() as c:
        now = (await c.execute(text("SELECT now()"))).scalar_one()
    earlier = now - timedelta(minutes=3)  # today (most likely), but in no minute the fold keeps
    yesterday = now - timedelta(days=1, minutes=5)
    subjects = [keys.request(uid("r")) for _ in range(9)]
    async with db.begin() as c:
        await ledger.seen(c, "h-live")
        await ledger.seen(c, "h-other")
        await ledger.insert(c, [
            reserve(subjects[0], a, 100, 50, holder="h-live"),  # open
            reserve(subjects[1], a, 100, 50, holder="h-live"),  # settled below
            reserve(subjects[2], a, 30, 10, holder="h-other", model="n"),  # refunded whole
            reserve(subjects[3], a, 30, 10, holder="h-other", model="n", tier="flex"),  # open
            reserve(subjects[4], b, 7, 7, holder="h-live", at=earlier),  # settled, earlier today
            reserve(subjects[5], b, 9, 9, holder="h-live", at=yesterday),  # open since yesterday
            reserve(subjects[6], b, 9, 9, holder="h-live", at=yesterday),  # settled yesterday
            reserve(keys.batch(uid("batch")), a, 1000, 2000, tier="batch", holder=None),  # open
            reserve(keys.batch(uid("batch")), b, 500, 500, tier="batch", holder=None, at=yesterday),
        ])
        await ledger.settle(c, Entry(ledger.SETTLE, subjects[1], a, "m", "default", 60, 5, "h-live"))
        await ledger.insert(c, [Entry(ledger.REFUND, subjects[2], a, "n", "default", 30, 10, "h-other")])
        await ledger.settle(c, Entry(ledger.SETTLE, subjects[4], b, "m", "default", 3, 4, "h-live"))
        await ledger.settle(c, Entry(ledger.SETTLE, subjects[6], b, "m", "default", 1, 1, "h-live"))
    async with db.begin() as c:
        await fold.reconcile(c, holder_ttl_s=3600)
        tenants = dict(tenants=[a, b])
        minutes = (await c.execute(text(
            "SELECT tenant, model, holder, starts_at, requests, input_tokens, output_tokens FROM quota_usage "
            "WHERE \"window\" = 'minute' AND tenant = ANY(:tenants) ORDER BY 1, 2, 3, 4"), tenants)).all()
        days = (await c.execute(text(
            "SELECT tenant, model, holder, requests, input_tokens, output_tokens, in_flight, batch_queue_tokens "
            "FROM quota_usage WHERE \"window\" = 'day' AND tenant = ANY(:tenants) ORDER BY 1, 2, 3"), tenants)).all()
        expected_minutes = (await c.execute(text(EXPECTED_MINUTES), tenants)).all()
        expected_days = (await c.execute(text(EXPECTED_DAYS), tenants)).all()
        assert [tuple(r) for r in minutes] == [tuple(r) for r in expected_minutes]
        assert [tuple(r) for r in days] == [tuple(r) for r in expected_days]
    # And the figures themselves, for the rows of tenant a this minute.
    by = {(r.model, r.holder): (r.requests, r.input_tokens, r.output_tokens) for r in minutes if r.tenant == a}
    assert by["m", "h-live"] == (2, 160, 55) and by["n", "h-other"] == (2, 30, 10)
    day = {(r.tenant, r.model, r.holder): r for r in days}
    assert day[a, "m", "h-live"].in_flight == 1 and day[a, "n", "h-other"].in_flight == 1
    assert day[a, "m", ""].batch_queue_tokens == 3000
    assert day[b, "m", ""].batch_queue_tokens == 1000  # open since yesterday: still enqueued
    assert day[b, "m", "h-live"].in_flight == 1  # open since yesterday: still in flight


async def test_a_dead_holders_open_reservations_expire_and_a_late_settle_still_counts(db):
    t = uid("t")
    dead, live = uid("h-dead"), uid("h-live")
    s_dead, s_done, s_live = (keys.request(uid("r")) for _ in range(3))
    async with db.begin() as c:
        await ledger.seen(c, dead)
        await ledger.seen(c, live)
        await c.execute(text("UPDATE admission_holders SET seen_at = now() - interval '1 minute' WHERE holder = :h"),
                        dict(h=dead))
        await ledger.insert(c, [reserve(s_dead, t, 10, 20, holder=dead), reserve(s_done, t, 10, 20, holder=dead),
                                reserve(s_live, t, 10, 20, holder=live)])
        await ledger.settle(c, Entry(ledger.SETTLE, s_done, t, "m", "default", 10, 3, dead))
    env = ActivityEnvironment()
    result = await env.run(QuotaActivities(db).reconcile_quota, ReconcileInput(holder_ttl_s=30))
    assert result.expired >= 1
    assert await rows(db, s_dead) == [("reserve", 10, 20), ("expire", 10, 20)]
    assert [k for k, *_ in await rows(db, s_done)] == ["reserve", "settle"]
    assert [k for k, *_ in await rows(db, s_live)] == ["reserve"]
    again = await env.run(QuotaActivities(db).reconcile_quota, ReconcileInput(holder_ttl_s=30))
    assert len(await rows(db, s_dead)) == 2 and again.rows >= 1  # expired once
    # The request's outcome is journaled after all (its workflow ran elsewhere): it counts.
    async with db.begin() as c:
        await ledger.settle(c, Entry(ledger.SETTLE, s_dead, t, "m", "default", 10, 4, dead))
        await fold.reconcile(c, holder_ttl_s=30)
        got = (await c.execute(text("SELECT requests, input_tokens, output_tokens, in_flight FROM quota_usage "
                                    "WHERE tenant = :t AND \"window\" = 'day' AND holder = :h"),
                               dict(t=t, h=dead))).one()
    assert tuple(got) == (2, 20, 7, 0)


async def test_cost_by_tenant_apportions_a_pools_hour_by_tokens_and_kv_occupancy(db):
    """`cost_by_tenant` against figures worked out by hand: the same 110 tokens cost a
    long answer to a short prompt far more KV-time than a short answer to a long one
    (p prompt tokens and n generated hold n·p + n(n+1)/2 token-steps); a training chunk's
    tokens count in the token share only."""
    model, a, b = uid("m"), uid("t"), uid("t")
    used = [(a, "default", 100, 10), (b, "default", 10, 100), (b, "training", 500, 0)]
    for tenant, tier, i, o in used:
        s = keys.request(uid("r"))
        async with db.begin() as c:
            await ledger.settle(c, Entry(ledger.SETTLE, s, tenant, model, tier, i, o),
                                reserve(s, tenant, i, o, model=model, tier=tier))
    async with db.connect() as c:
        got = {r.tenant: r for r in (await c.execute(text(
            "SELECT * FROM cost_by_tenant WHERE model = :m"), dict(m=model))).all()}
    kv_a, kv_b = 100 * 10 + 10 * 11 // 2, 10 * 100 + 100 * 101 // 2  # 1,055 and 6,050
    assert (got[a].input_tokens, got[a].output_tokens, got[a].kv_token_steps) == (100, 10, kv_a)
    assert (got[b].input_tokens, got[b].output_tokens, got[b].kv_token_steps) == (510, 100, kv_b)
    assert got[a].token_share == pytest.approx(110 / 720) and got[b].token_share == pytest.approx(610 / 720)
    assert got[a].kv_share == pytest.approx(kv_a / (kv_a + kv_b)) and got[b].kv_share == pytest.approx(kv_b / 7105)
