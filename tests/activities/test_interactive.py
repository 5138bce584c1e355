"""Every request an engine served is accounted for once: journaled and settled from its
window's outcome or, where no API reported it (the process died mid-stream), from the
engine worker's record; whichever comes second changes nothing. Checked in SQL."""

import dataclasses

from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.interactive import RequestActivities, account_unreported
from journal import ledger
from journal.events import append
from journal.served import ServedRecords
from protocol import keys
from protocol.temporal import InteractiveInput, JournalRequestInput, RequestOutcome, RequestWindowInput
from tests.helpers import uid


async def engine_served(db, rid: str, tenant: str, prompt: int = 5, completion: int = 7) -> None:
    """As the engine worker records a request when its stream ends (cut short here)."""
    record = dict(request_id=rid, tenant=tenant, tier="default", model="m", endpoint="/v1/chat/completions",
                  prompt_tokens=prompt, completion_tokens=completion, finish_reason=None)
    await served_by_engine(db, record)


async def served_by_engine(db, *records: dict) -> None:
    served = ServedRecords("engine-1")
    for r in records:
        served.add(r)
    async with db.begin() as c:
        await append(c, served.due())


async def reserved_by_api(db, rid: str, tenant: str, i: int = 5, o: int = 100) -> None:
    async with db.begin() as c:
        await ledger.insert(c, [ledger.Entry(ledger.RESERVE, keys.request(rid), tenant, "m", "default", i, o,
                                             "api-dead")])


async def finished(db, rid: str) -> list[dict]:
    async with db.connect() as c:
        q = text("SELECT record FROM finished_requests WHERE request_id = :r")
        return [r[0] for r in (await c.execute(q, dict(r=rid))).all()]


async def ledger_rows(db, rid: str) -> list[tuple]:
    async with db.connect() as c:
        q = text("SELECT kind, input_tokens, output_tokens FROM ledger WHERE subject = :s ORDER BY position")
        return [tuple(r) for r in (await c.execute(q, dict(s=keys.request(rid)))).all()]


def outcome_of(rid: str, tenant: str, status="completed", completion: int = 7) -> JournalRequestInput:
    return JournalRequestInput(InteractiveInput(rid, tenant, "default", "m", "/v1/chat/completions", "engine-1", 5),
                               RequestOutcome(status, completion, "length"))


async def test_a_request_no_api_reported_is_journaled_and_settled_from_the_engines_record(db):
    tenant, rid = uid("t"), uid("r")
    await reserved_by_api(db, rid, tenant)  # the API's flusher wrote its reservation, then the process died
    await engine_served(db, rid, tenant)
    await account_unreported(db, after_s=3600)
    assert await finished(db, rid) == []  # not unreported for that long yet
    assert await account_unreported(db, after_s=0) >= 1
    [got] = await finished(db, rid)
    assert (got["status"], got["prompt_tokens"], got["completion_tokens"], got["engine_id"]) == \
        ("abandoned", 5, 7, "engine-1")
    # Settled for exactly what the engine served, which closes the reservation.
    assert await ledger_rows(db, rid) == [("reserve", 5, 100), ("settle", 5, 7)]
    await account_unreported(db, after_s=0)  # a second sweep: nothing more
    assert len(await finished(db, rid)) == 1 and len(await ledger_rows(db, rid)) == 2


async def test_a_reported_request_is_left_alone_and_a_late_outcome_changes_nothing(db):
    acts, env = RequestActivities(db), ActivityEnvironment()
    tenant, reported, late = uid("t"), uid("r"), uid("r")
    for rid in (reported, late):
        await reserved_by_api(db, rid, tenant)
        await engine_served(db, rid, tenant)
    await env.run(acts.journal_request, outcome_of(reported, tenant))  # its API reported it
    await account_unreported(db, after_s=0)
    [got] = await finished(db, reported)
    assert got["status"] == "completed"
    assert await ledger_rows(db, reported) == [("reserve", 5, 100), ("settle", 5, 7)]
    # The sweep came first for `late`; its workflow's outcome arrives after: journaled once.
    await env.run(acts.journal_request, outcome_of(late, tenant, "abandoned", completion=0))
    [got] = await finished(db, late)
    assert (got["status"], got["completion_tokens"]) == ("abandoned", 7)
    assert await ledger_rows(db, late) == [("reserve", 5, 100), ("settle", 5, 7)]


async def test_an_unreadable_record_does_not_hold_up_the_others(db):
    """A record an engine did not write whole (hand-made, or from a broken worker) is
    skipped and logged; every other is still accounted for."""
    tenant, bad, good = uid("t"), uid("r"), uid("r")
    await served_by_engine(db, dict(request_id=bad))
    await reserved_by_api(db, good, tenant)
    await engine_served(db, good, tenant)
    assert await account_unreported(db, after_s=0) >= 1
    assert await finished(db, bad) == [] and len(await finished(db, good)) == 1


async def test_a_window_is_journaled_in_one_transaction_and_again_changes_nothing(db):
    """A window's requests: one `request_finished` event listing them (one tenant) and
    exactly their ledger rows, whether or not the API's flusher wrote their reservation
    first; a retried activity writes nothing more (each request's settle is there)."""
    acts, env = RequestActivities(db), ActivityEnvironment()
    tenant, rids = uid("t"), [uid("r") for _ in range(5)]
    await reserved_by_api(db, rids[0], tenant)  # a long request: its reservation was flushed
    requests = [dataclasses.replace(o.request, outcome=o.outcome, reserved_input=5, reserved_output=50)
                for o in (outcome_of(rid, tenant, completion=3 + i) for i, rid in enumerate(rids))]
    window = RequestWindowInput("api-1", requests)
    assert await env.run(acts.journal_window, window) == 5
    assert await env.run(acts.journal_window, window) == 0  # retried: every one journaled already
    async with db.connect() as c:
        events = (await c.execute(text("SELECT count(*) FROM events WHERE tenant = :t AND type = 'request_finished'"),
                                  dict(t=tenant))).scalar_one()
    assert events == 1
    for i, rid in enumerate(rids):
        [got] = await finished(db, rid)
        assert (got["status"], got["completion_tokens"]) == ("completed", 3 + i)
        # The flusher's reservation stands where it wrote one; the window's where it had not.
        held = 100 if i == 0 else 50
        assert await ledger_rows(db, rid) == [("reserve", 5, held), ("settle", 5, 3 + i)]


async def test_a_window_holding_a_request_its_engine_record_settled_journals_the_rest(db):
    acts, env = RequestActivities(db), ActivityEnvironment()
    tenant, swept, rest = uid("t"), uid("r"), [uid("r") for _ in range(3)]
    await reserved_by_api(db, swept, tenant)
    await engine_served(db, swept, tenant)
    assert await account_unreported(db, after_s=0) >= 1  # the sweep came first for `swept`
    window = RequestWindowInput("api-1", [dataclasses.replace(o.request, outcome=o.outcome)
                                          for o in (outcome_of(rid, tenant) for rid in [swept, *rest])])
    assert await env.run(acts.journal_window, window) == 3
    [got] = await finished(db, swept)
    assert got["status"] == "abandoned"  # the engine's record stands: journaled once
    assert await ledger_rows(db, swept) == [("reserve", 5, 100), ("settle", 5, 7)]
    for rid in rest:
        assert [g["status"] for g in await finished(db, rid)] == ["completed"]
        assert await ledger_rows(db, rid) == [("settle", 5, 7)]


async def test_an_engine_tick_journals_its_records_once_per_tenant(db):
    """What an engine worker served in a tick: one `request_served` event per tenant, every
    record once in `served_requests` (with the engine named), and nothing the next tick."""
    a, b = uid("t"), uid("t")
    rids = {rid: tenant for rid, tenant in ((uid("r"), t) for t in (a, a, a, b, b))}
    served = ServedRecords("engine-7")
    for rid, tenant in rids.items():
        served.add(dict(request_id=rid, tenant=tenant, tier="default", model="m", prompt_tokens=3,
                        completion_tokens=4))
    events = served.due()
    assert sorted(e.tenant for e in events) == sorted([a, b]) and served.due() == []
    async with db.begin() as c:
        await append(c, events)
    async with db.connect() as c:
        rows = (await c.execute(text("SELECT request_id, tenant, engine_id, (record->>'completion_tokens')::int "
                                     "FROM served_requests WHERE tenant IN (:a, :b)"), dict(a=a, b=b))).all()
    assert sorted(tuple(r) for r in rows) == sorted((rid, t, "engine-7", 4) for rid, t in rids.items())
