"""Admission at the API: a tenant over a limit gets OpenAI's 429 with Retry-After before
any engine work; concurrency is capped; a finished request's settle closes its
reservation in the ledger; flex is shed before default. And the local view itself: another
process's admissions are seen once folded, a dead process's reservations expire, the
synchronous baseline agrees.

In process, through the `other_api` client (a tenant of its own, new per test, so limits
set here touch no other test): the real journal and ledger on the test database; the
engine is a fake that speaks engine/server.py's NDJSON protocol (it can hold a request in
flight), and Temporal a fake that records the request's workflow input and outcome,
which the real journaling activity then writes.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

import httpx
import pytest
from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.interactive import RequestActivities
from activities.quota import QuotaActivities
from api.services.admission import Admission, Ticket
from journal import ledger, tenant_store
from policy.admission import Refuse
from policy.placement import EngineView
from protocol import keys
from protocol.temporal import ReconcileInput
from protocol.tiers import Tier
from tests.api.conftest import Workflows, assert_openai_error

CHAT = "/v1/chat/completions"
MODEL = "ballast-tiny"
PROMPT_TOKENS = 3


def body(tier: str = "default", max_tokens: int = 50, **extra) -> dict:
    return dict(model=MODEL, messages=[dict(role="user", content="hi")], max_tokens=max_tokens, service_tier=tier,
                **extra)


class FakeEngine:
    """One engine worker: accepts (prompt_tokens), streams `tokens` tokens, finishes;
    while `hold` is set a request waits after being accepted (it is in flight)."""

    def __init__(self, tokens: int = 1):
        self.tokens, self.calls = tokens, 0
        self.jobs: list[dict] = []  # what the API handed it
        self.hold: asyncio.Event | None = None
        self.fail = False

    def transport(self) -> httpx.MockTransport:
        def generate(request: httpx.Request) -> httpx.Response:
            self.calls += 1
            self.jobs.append(json.loads(request.content))
            return httpx.Response(200, content=self._stream(self.hold),
                                  headers={"content-type": "application/x-ndjson"})

        return httpx.MockTransport(generate)

    async def _stream(self, hold):
        yield json.dumps({"prompt_tokens": PROMPT_TOKENS}).encode() + b"\n"
        if hold is not None:
            await hold.wait()
        for _ in range(self.tokens):
            yield json.dumps({"text": "a", "tokens": 1}).encode() + b"\n"
        if self.fail:
            yield json.dumps({"error": {"message": "boom", "type": "server_error", "param": None,
                                        "code": "engine_error"}, "status": 500}).encode() + b"\n"
            return
        yield json.dumps({"finish_reason": "length", "completion_tokens": self.tokens}).encode() + b"\n"


class OneEngine:
    started = 0  # when the directory started (GET /v1/models's `created`)

    def __init__(self, interactive: int = 0, flex: int = 0, flex_floor: int = 0, reserved_free=frozenset()):
        self.interactive, self.flex, self.flex_floor, self.reserved_free = interactive, flex, flex_floor, reserved_free

    async def live(self):
        return [EngineView("engine-1", "http://engine.test", MODEL, self.interactive, 0, 4, self.flex, self.flex_floor,
                           reserved_free=self.reserved_free)]


class Harness:
    def __init__(self, client: httpx.AsyncClient, tenant: str, admission: Admission, engine: FakeEngine,
                 workflows: Workflows, db):
        self.client, self.tenant, self.admission, self.engine, self.workflows, self.db = (
            client, tenant, admission, engine, workflows, db)
        self.svc = client._transport.app.state.services  # type: ignore[attr-defined]

    async def limit(self, model: str = "*", **dims: int | None) -> None:
        async with self.db.begin() as conn:
            await tenant_store.set_limits(conn, self.tenant, model, **dims)
        await self.admission.refresh()

    async def chat(self, **kw) -> httpx.Response:
        return await self.client.post(CHAT, json=body(**kw))

    async def ledger_kinds(self) -> list[str]:
        """The tenant's ledger rows' kinds, in order, once this process has written what it holds."""
        await self.admission.flush()
        await self.svc.settlement.flush()
        async with self.db.connect() as c:
            return (await c.execute(text("SELECT array_agg(kind ORDER BY position) FROM ledger WHERE tenant = :t"),
                                    dict(t=self.tenant))).scalar_one()

    def in_flight(self) -> int:
        now = time.time()
        return self.admission.usage(self.tenant, "*", MODEL, math.floor(now / 60) * 60,
                                    math.floor(now / 86400) * 86400).in_flight

    async def journal_all(self) -> None:
        """What the windows' workflows would do: journal each outcome (the real activity)."""
        await self.svc.settlement.flush()
        acts, env = RequestActivities(self.db), ActivityEnvironment()
        for window in self.workflows.windows:
            assert await env.run(acts.journal_window, window) == len(window.requests)


async def fresh_window(need_s: float = 8.0) -> None:
    """Start where the current minute has `need_s` left at least (windows are fixed)."""
    left = 60 - time.time() % 60
    if left < need_s:
        await asyncio.sleep(left + 0.05)


@pytest.fixture
async def harness(other_api, settings, db):
    key = other_api.headers["Authorization"].split()[1]
    async with db.connect() as conn:
        principal = await tenant_store.lookup(conn, key)
    assert principal is not None
    svc = other_api._transport.app.state.services  # the `other_api` app's services, rewired here
    engine, workflows = FakeEngine(), Workflows()
    svc.engines, svc.temporal = OneEngine(), workflows
    svc.http = httpx.AsyncClient(transport=engine.transport())
    admission = svc.admission = await Admission(db, settings, holder=f"test-{uuid.uuid4().hex[:8]}").start()
    try:
        yield Harness(other_api, principal.tenant, admission, engine, workflows, db)
    finally:
        await svc.settlement.flush()
        await admission.stop()


async def ledger_rows(db, subject: str) -> list[tuple]:
    async with db.connect() as c:
        q = text("SELECT kind, tier, input_tokens, output_tokens FROM ledger WHERE subject = :s ORDER BY position")
        return [tuple(r) for r in (await c.execute(q, dict(s=subject))).all()]


# -- through the API ------------------------------------------------------------------------


async def test_over_the_rpm_limit_is_a_429_in_openais_shape_with_retry_after(harness):
    await harness.limit(requests_per_min=3)
    await fresh_window()
    for _ in range(3):  # right up to the limit: admitted
        assert (await harness.chat(tier="priority")).status_code == 200
    r = await harness.chat(tier="priority")
    err = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert err["type"] == "rate_limit_error" and err["param"] is None
    assert "requests per min (RPM)" in err["message"] and "Limit 3" in err["message"], err
    retry = int(r.headers["Retry-After"])
    assert 1 <= retry <= 60 and abs(retry - (60 - time.time() % 60)) <= 1.5
    assert harness.engine.calls == 3  # refused before any engine work


async def test_concurrent_requests_are_capped_and_a_finished_one_frees_its_slot(harness):
    await harness.limit(concurrent_requests=2)
    harness.engine.hold = asyncio.Event()
    held = [asyncio.create_task(harness.chat(tier="priority")) for _ in range(2)]
    while harness.in_flight() < 2:
        await asyncio.sleep(0.01)
    r = await harness.chat(tier="priority")
    err = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert "concurrent requests" in err["message"] and r.headers["Retry-After"] == "1"
    harness.engine.hold.set()
    assert [(await t).status_code for t in held] == [200, 200]
    assert harness.in_flight() == 0
    harness.engine.hold = None
    assert (await harness.chat(tier="priority")).status_code == 200


async def test_a_failed_request_releases_its_reservation_at_once(harness):
    await harness.limit(concurrent_requests=1)
    harness.engine.fail = True
    r = await harness.chat(tier="priority")
    assert_openai_error(r, 502, code="engine_error")
    assert harness.in_flight() == 0
    harness.engine.fail = False
    assert (await harness.chat(tier="priority")).status_code == 200


async def test_the_settle_closes_the_reservation_with_what_was_used(harness, db):
    harness.engine.tokens = 4
    r = await harness.chat(max_tokens=50)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    await harness.journal_all()
    await harness.admission.flush()  # the flusher's write comes after: the first row stands
    [record] = harness.workflows.started
    assert (record.reserved_input, record.reserved_output, record.holder) == (PROMPT_TOKENS, 50,
                                                                                harness.admission.holder)
    assert await ledger_rows(db, keys.request(record.request_id)) == [
        ("reserve", "default", PROMPT_TOKENS, 50), ("settle", "default", PROMPT_TOKENS, 4)]


async def test_a_counted_reservation_is_written_at_the_next_flush(harness, db):
    """A prompt the API tokenized as the engine will needs no correction: its reserve row
    goes at the next tick; an estimated one waits a tick for the engine's figure. Where
    the engine's figure differs from the count before the row is written, it wins."""
    counted = await harness.admission.reserve(uuid.uuid4().hex, harness.tenant, MODEL, "default", 7, 5, counted=True)
    differs = await harness.admission.reserve(uuid.uuid4().hex, harness.tenant, MODEL, "default", 7, 5, counted=True)
    estimated = await harness.admission.reserve(uuid.uuid4().hex, harness.tenant, MODEL, "default", 7, 5)
    differs.correct(9)
    await harness.admission.flush()
    assert await ledger_rows(db, counted.subject) == [("reserve", "default", 7, 5)]
    assert await ledger_rows(db, differs.subject) == [("reserve", "default", 9, 5)]
    assert await ledger_rows(db, estimated.subject) == []
    estimated.correct(6)
    await harness.admission.flush()
    assert await ledger_rows(db, estimated.subject) == [("reserve", "default", 6, 5)]


async def test_several_choices_reserve_max_tokens_each_in_the_ledger(harness, db):
    three = await harness.admission.reserve(uuid.uuid4().hex, harness.tenant, MODEL, "default", 7, 5, choices=3)
    three.correct(8)  # the engine's count keeps the choices
    await harness.admission.flush()
    assert await ledger_rows(db, three.subject) == [("reserve", "default", 8, 15)]


async def test_an_engine_refusal_refunds_the_whole_reservation(harness, db):
    refusal = {"error": {"message": "too long", "type": "invalid_request_error", "param": "messages",
                         "code": "context_length_exceeded"}, "status": 400}
    svc = harness.client._transport.app.state.services
    svc.http = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda _: httpx.Response(200, content=json.dumps(refusal).encode() + b"\n")))
    assert (await harness.chat()).status_code == 400
    assert harness.in_flight() == 0
    assert await harness.ledger_kinds() == ["reserve", "refund"] and harness.workflows.started == []


def shed_line(retry_after_s: int) -> bytes:
    """An engine worker's refusal of a request that would wait past its tier's bound."""
    return json.dumps({"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                 "code": "resource_unavailable"}, "status": 429,
                       "retry_after_s": retry_after_s}).encode() + b"\n"


class TwoEngines:
    async def live(self):
        return [EngineView(f"engine-{i}", f"http://engine-{i}.test", MODEL, i, 0, 4) for i in (1, 2)]


async def test_a_request_every_engine_refuses_for_the_wait_is_a_429_with_the_soonest_retry_and_refunded(harness, db):
    svc = harness.client._transport.app.state.services
    svc.engines, asked = TwoEngines(), []

    def full(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        return httpx.Response(200, content=shed_line(7 if request.url.host == "engine-1.test" else 3))

    svc.http = httpx.AsyncClient(transport=httpx.MockTransport(full))
    r = await harness.chat()
    err = assert_openai_error(r, 429, code="resource_unavailable")
    assert r.headers["retry-after"] == "3" and "try again in 3 s" in err["message"]
    assert "the bound on the" in err["message"]  # what `bench overload` tells a refusal for the wait by
    assert asked == ["engine-1.test", "engine-2.test"]  # the less loaded first, then the other
    assert harness.in_flight() == 0 and not any(svc.placer.inflight.values())
    assert await harness.ledger_kinds() == ["reserve", "refund"] and harness.workflows.started == []


async def test_a_request_one_engine_refuses_for_the_wait_is_served_by_the_next(harness):
    svc = harness.client._transport.app.state.services
    svc.engines, served = TwoEngines(), harness.engine.transport()

    async def first_full(request: httpx.Request) -> httpx.Response:
        if request.url.host == "engine-1.test":
            return httpx.Response(200, content=shed_line(5))
        return await served.handle_async_request(request)

    svc.http = httpx.AsyncClient(transport=httpx.MockTransport(first_full))
    r = await harness.chat()
    assert r.status_code == 200, r.text
    assert harness.engine.calls == 1
    await svc.settlement.flush()
    assert [w.requests[0].engine_id for w in harness.workflows.windows] == ["engine-2"]


async def test_flex_is_shed_before_default(harness):
    await harness.limit(requests_per_min=10)
    await fresh_window()
    codes = [(await harness.chat(tier="flex")).status_code for _ in range(9)]
    assert codes == [200] * 8 + [429]  # flex yields at 80% of the limit
    r = await harness.chat(tier="flex")
    assert "for flex requests, which yield at 80% of the limit" in r.json()["error"]["message"]
    assert (await harness.chat(tier="default")).status_code == 200  # default still has room
    assert (await harness.chat(tier="default")).status_code == 200
    assert (await harness.chat(tier="default")).status_code == 429  # at 95%: default yields too
    assert (await harness.chat(tier="priority")).status_code == 429  # and the limit is the limit


async def test_flex_is_shed_while_every_engine_is_busy(harness, settings):
    svc = harness.client._transport.app.state.services
    svc.engines = OneEngine(interactive=4)  # 4 of 4 slots: past surge_high
    r = await harness.chat(tier="flex")
    assert_openai_error(r, 429, code="resource_unavailable")
    assert (await harness.chat(tier="default")).status_code == 200


async def test_a_tenants_flex_is_not_shed_while_its_reserved_slot_is_free(harness):
    svc = harness.client._transport.app.state.services
    svc.engines = OneEngine(interactive=4, reserved_free=frozenset({harness.tenant}))
    assert (await harness.chat(tier="flex")).status_code == 200
    svc.engines = OneEngine(interactive=4, reserved_free=frozenset({"someone-else"}))
    assert_openai_error(await harness.chat(tier="flex"), 429, code="resource_unavailable")


async def test_flex_below_its_floor_is_admitted_while_every_engine_is_busy(harness):
    # Continuous chat must not shut flex out: below its floor on the engine (1 slot), flex
    # is admitted and waits its turn there; at its floor, it is shed again.
    svc = harness.client._transport.app.state.services
    svc.engines = OneEngine(interactive=4, flex=0, flex_floor=1)
    assert (await harness.chat(tier="flex")).status_code == 200
    svc.engines = OneEngine(interactive=4, flex=1, flex_floor=1)
    assert_openai_error(await harness.chat(tier="flex"), 429, code="resource_unavailable")


async def test_a_per_model_limit_applies_with_the_tenants(harness):
    await harness.limit("*", requests_per_min=100)
    await harness.limit(MODEL, requests_per_min=2)
    await fresh_window()
    assert [(await harness.chat(tier="priority")).status_code for _ in range(3)] == [200, 200, 429]
    r = await harness.chat(tier="priority")
    assert f"Rate limit reached for {MODEL} in tenant {harness.tenant}" in r.json()["error"]["message"]


# -- the local view ----------------------------------------------------------------------------


async def reconcile(db, ttl_s: float = 30.0):
    return await ActivityEnvironment().run(QuotaActivities(db).reconcile_quota, ReconcileInput(ttl_s))


async def test_another_processes_admissions_count_once_folded(harness, settings, db, services_db):
    """Process A admits; once its flusher, the fold and B's refresh have run, B counts
    them: B admits only what is left of the limit (and A's own count is exact all along)."""
    await harness.limit(requests_per_min=5)
    await fresh_window(need_s=15)
    a = harness.admission
    b = await Admission(db, settings, holder=f"test-b-{uuid.uuid4().hex[:6]}").start()
    try:
        for _ in range(3):
            assert isinstance(a.reserve_local(uuid.uuid4().hex, harness.tenant, MODEL, "priority", 5, 5, 5), Ticket)
        await a.flush()
        await a.flush()  # uncorrected reservations wait one tick for the engine's figures
        await reconcile(services_db)  # the control worker's
        await b.refresh()
        got = [b.reserve_local(uuid.uuid4().hex, harness.tenant, MODEL, "priority", 5, 5, 5) for _ in range(3)]
        assert [isinstance(g, Ticket) for g in got] == [True, True, False]
        assert isinstance(got[2], Refuse) and got[2].used == 5
        # A has not seen B's two yet: it admits up to the limit as it sees it, the
        # overshoot the declared bound allows ((P − 1) × at most the limit).
        more = [a.reserve_local(uuid.uuid4().hex, harness.tenant, MODEL, "priority", 5, 5, 5) for _ in range(3)]
        assert [isinstance(g, Ticket) for g in more] == [True, True, False]
        for adm in (a, b, a, b):
            await adm.flush()
        await reconcile(services_db)  # the control worker's
        for adm in (a, b):
            await adm.refresh()
            refused = adm.reserve_local(uuid.uuid4().hex, harness.tenant, MODEL, "priority", 5, 5, 5)
            assert isinstance(refused, Refuse) and refused.used == 7
    finally:
        await b.stop()


async def test_a_killed_processes_reservations_expire(settings, db, services_db):
    async with db.begin() as conn:
        await tenant_store.ensure_tenant(conn, "expiry")
    holder = f"doomed-{uuid.uuid4().hex[:8]}"
    a = await Admission(db, settings, holder=holder).start()
    tickets = [a.reserve_local(uuid.uuid4().hex, "expiry", MODEL, "default", 10, 20, 20) for _ in range(3)]
    assert all(isinstance(t, Ticket) for t in tickets)
    await a.stop()  # the process is gone: its reservations were written, never settled
    await asyncio.sleep(1.2)
    await reconcile(services_db, ttl_s=1.0)
    async with db.connect() as c:
        rows = (await c.execute(text("SELECT kind, count(*) FROM ledger WHERE holder = :h GROUP BY kind ORDER BY kind"),
                                dict(h=holder))).all()
    assert [tuple(r) for r in rows] == [("expire", 3), ("reserve", 3)]


async def test_the_synchronous_baseline_admits_exactly_to_the_limit(harness, settings, db):
    await harness.limit(requests_per_min=4, concurrent_requests=10)
    await fresh_window()
    sync = Admission(db, settings.model_copy(update=dict(admission_mode="sync")), holder=f"sync-{uuid.uuid4().hex[:6]}")
    got = [await sync.reserve(uuid.uuid4().hex, harness.tenant, MODEL, "priority", 5, 5) for _ in range(5)]
    assert [isinstance(g, Ticket) for g in got] == [True] * 4 + [False]
    assert isinstance(got[4], Refuse) and got[4].used == 4
    async with db.connect() as c:  # written at admission, in the deciding transaction
        n = (await c.execute(text("SELECT count(*) FROM ledger WHERE tenant = :t AND kind = 'reserve'"),
                             dict(t=harness.tenant))).scalar_one()
    assert n == 4
    got[0].cancel()
    await sync.flush()
    assert (await ledger_rows(db, got[0].subject))[-1][0] == "refund"


@pytest.mark.parametrize("mode", ["local", "sync"])
async def test_fine_tuning_spends_the_same_daily_tokens_as_chat(harness, services_db, mode):
    """Training settles its tokens with no reservation (on an engine worker); the API's
    admission counts them against tokens_per_day all the same, in either mode."""
    harness.admission.mode = mode
    await harness.limit(tokens_per_day=1000)
    await harness.admission.refresh()
    assert (await harness.chat()).status_code == 200  # well under the day's tokens
    async with services_db.begin() as conn:  # a training chunk's settle, as the engine worker writes it
        await ledger.insert(conn, [ledger.Entry(ledger.SETTLE, keys.ftjob_step(f"ftjob-{uuid.uuid4().hex}", 8),
                                                harness.tenant, MODEL, Tier.TRAINING, 1000, 0)])
    async with services_db.connect() as conn:
        trained = (await conn.execute(text("SELECT sum(input_tokens) FROM ledger WHERE tenant = :t AND tier = "
                                           "'training'"), dict(t=harness.tenant))).scalar()
    assert trained == 1000  # the day's whole allowance, by training alone
    await harness.admission.refresh()  # the local view learns it as it learns other holders'
    assert_openai_error(await harness.chat(), 429, code="rate_limit_exceeded")


async def test_a_clients_request_id_reaches_the_engine_and_the_journal(harness, db):
    mine = f"client-{uuid.uuid4().hex}"
    r = await harness.client.post(CHAT, json=body(), headers={"x-request-id": mine})
    assert r.status_code == 200 and r.headers["x-request-id"] == mine, r.text
    assert harness.engine.jobs[-1]["http_request_id"] == mine
    await harness.journal_all()
    async with db.connect() as c:
        journaled = (await c.execute(text(
            "SELECT record->>'http_request_id' FROM finished_requests WHERE request_id = :r"),
            dict(r=r.json()["id"]))).scalar()
    assert journaled == mine
