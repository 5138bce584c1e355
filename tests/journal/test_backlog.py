"""The control worker's view of what waits (journal/backlog.py, ballast/gauges.py), against
what the test wrote itself: its tenant's pending items and the age of its open batch, the
fold's age as Postgres tells it, and a pool's surge from the journal's last surge event."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from ballast import gauges
from journal import backlog, batch_store
from journal.events import NewEvent, append
from protocol.batch import Item
from protocol.events import EventType
from tests.conftest import engine_at, migrated_database, service_url_for


@pytest.fixture
async def dbs(pg_server_url):
    """A database of its own (a batch left in progress here would be a stuck one elsewhere):
    (the services' engine, the owner's)."""
    with migrated_database(pg_server_url, "ballast_backlog") as url:
        async with engine_at(service_url_for(url)) as services, engine_at(url) as owner:
            yield services, owner


async def test_the_backlog_and_its_gauges(dbs):
    services_db, owner_db = dbs
    tenant, pool = f"backlog-{uuid.uuid4().hex[:8]}", f"pool-{uuid.uuid4().hex[:8]}"
    created = int(time.time()) - 600
    async with services_db.begin() as conn:
        for n, status in ((3, "in_progress"), (2, "completed")):  # an ended batch's items wait for nothing
            batch_id = "batch_" + uuid.uuid4().hex[:24]
            await batch_store.create_batch(conn, dict(id=batch_id, tenant=tenant, endpoint="/v1/completions",
                                                      input_file_id="file-x", completion_window="24h", metadata=None,
                                                      status=status, created_at=created, expires_at=created + 86400))
            await batch_store.add_items(conn, batch_id, tenant, [Item(i, i + 1, f"c{i}", dict(prompt="x"))
                                                                 for i in range(n)])
        stream = f"fleet:{pool}"
        await append(conn, [NewEvent(stream, EventType.SURGE_STARTED, dict(pressure=1.0), f"{pool}:s", "system"),
                            NewEvent(stream, EventType.SURGE_ENDED, dict(pressure=0.1), f"{pool}:e", "system"),
                            NewEvent(stream, EventType.SURGE_STARTED, dict(pressure=1.0), f"{pool}:s2", "system")])
    async with services_db.connect() as conn:
        mine = [b for b in await backlog.batch_backlog(conn) if b.tenant == tenant]
        assert len(mine) == 1 and mine[0].items == 3 and 600 <= mine[0].oldest_s < 700
        assert (await backlog.surging(conn))[pool] is True
        age = await backlog.fold_age_s(conn)
    async with owner_db.connect() as conn:
        folded = (await conn.execute(text("SELECT extract(epoch FROM now() - folded_at) FROM quota_fold"))).scalar()
    assert (age is None) == (folded is None)

    await gauges.refresh(services_db)
    assert REGISTRY.get_sample_value("ballast_batch_backlog_items", dict(tenant=tenant)) == 3
    assert 600 <= REGISTRY.get_sample_value("ballast_batch_oldest_pending_seconds", dict(tenant=tenant)) < 700
    assert REGISTRY.get_sample_value("ballast_fleet_surging", dict(pool=pool)) == 1


async def test_the_autoscaling_signal_from_the_engines_announcements(dbs):
    """Two readings of an engine's announced batch tokens make its pace; with its queued
    tokens and interactive load, ballast_engines_wanted is policy/autoscale.py's answer."""
    from journal import engine_registry
    from policy.autoscale import PoolLoad, ScalePolicy, engines_wanted
    from protocol.engine_wire import EngineStats

    services_db, owner_db = dbs
    model, policy = f"m-{uuid.uuid4().hex[:6]}", ScalePolicy(target_busy=0.5, drain_s=10, min_engines=1)
    async with owner_db.begin() as conn:  # 1,000 tokens of open batch work, as the fold sums them
        await conn.execute(text("INSERT INTO quota_open_sums (tenant, model, holder, reservations, in_flight, "
                                "batch_queue_tokens) VALUES ('t', :m, 'h', 1, 0, 1000)"), dict(m=model))

    async def announce(tokens: int) -> None:
        async with services_db.begin() as conn:
            await engine_registry.announce(conn, "e1", "http://e1", model, "q", EngineStats(
                max_seqs=8, interactive=5, batch_tokens=tokens).to_json())

    pace = gauges.Pace()
    await announce(1000)
    await gauges.refresh(services_db, policy, pace, now=100.0)
    assert REGISTRY.get_sample_value("ballast_pool_engines", dict(model=model, region="")) == 1
    assert REGISTRY.get_sample_value("ballast_batch_queued_tokens", dict(model=model)) == 1000
    # Its pace unmeasured: ceil(5 / (8 × 0.5)) = 2 for interactive, 1 for what is queued.
    assert REGISTRY.get_sample_value("ballast_engines_wanted", dict(model=model)) == 3
    await announce(1500)  # 50 tokens a second since
    await gauges.refresh(services_db, policy, pace, now=110.0)
    # 2 for interactive; 1,000 tokens at 50 a second within 10 s: ceil(1000 / 500) = 2.
    want = engines_wanted(PoolLoad(engines=1, slots=8, interactive=5, queued_tokens=1000, tokens_per_s=50.0), policy)
    assert REGISTRY.get_sample_value("ballast_engines_wanted", dict(model=model)) == want == 4


async def test_quota_use_against_each_limit(dbs):
    """What the test reserved, settled and trained, folded: each limit set on the tenant
    with what admission counts against it, and the gauges beside it."""
    from journal import fold, ledger, tenant_store
    from journal.ledger import Entry

    services_db, owner_db = dbs
    tenant, model = f"quota-{uuid.uuid4().hex[:8]}", "m"
    if time.time() % 60 > 50:  # the minute's figures are the minute's: not across its end
        await asyncio.sleep(61 - time.time() % 60)
    async with owner_db.begin() as conn:
        await tenant_store.create_tenant(conn, tenant)
        await tenant_store.set_limits(conn, tenant, requests_per_min=100, input_tokens_per_min=1000,
                                      concurrent_requests=5, tokens_per_day=100_000, batch_queue_tokens=10_000,
                                      concurrent_fine_tunes=2, output_tokens_per_min=None)
        await tenant_store.set_limits(conn, tenant, "other-model", requests_per_min=7)
    settled = Entry("reserve", f"request:{tenant}-1", tenant, model, "default", 10, 20, "h")
    async with services_db.begin() as conn:
        await ledger.insert(conn, [
            settled, settled.closing("settle", 10, 5),  # 15 tokens used of 30 reserved
            Entry("reserve", f"request:{tenant}-2", tenant, model, "default", 7, 8, "h"),  # in flight
            Entry("reserve", f"batch:{tenant}", tenant, model, "batch", 100, 200, "h"),  # queued batch tokens
            Entry("settle", f"ft:{tenant}", tenant, model, "training", 30, 0)])  # trained: the day's tokens
    async with owner_db.begin() as conn:
        await fold.fold(conn)
    async with services_db.connect() as conn:
        use = {(q.model, q.limit): (q.used, q.allowed) for q in await backlog.quota_use(conn) if q.tenant == tenant}
    assert use == {("*", "requests_per_min"): (2, 100), ("*", "input_tokens_per_min"): (17, 1000),
                   ("*", "concurrent_requests"): (1, 5), ("*", "tokens_per_day"): (15 + 15 + 30, 100_000),
                   ("*", "batch_queue_tokens"): (300, 10_000), ("*", "concurrent_fine_tunes"): (0, 2),
                   ("other-model", "requests_per_min"): (0, 7)}
    await gauges.refresh(services_db)
    labels = dict(tenant=tenant, model="*", limit="tokens_per_day")
    assert REGISTRY.get_sample_value("ballast_quota_used", labels) == 60
    assert REGISTRY.get_sample_value("ballast_quota_limit", labels) == 100_000
