"""Journal interactive requests' outcomes: who, which tier, where, how many tokens.

Each API process hands the requests that ended in a window to one workflow
(api/services/settlement.py); `journal_window` journals them all in one transaction: in
the quota ledger their reservations (unless the API's flusher has written them already),
a settle row each of exactly the tokens its outcome records (prompt_tokens,
completion_tokens), which closes its reservation; in the journal
one `request_finished` event per tenant, the list of their outcomes (read a row a request
through the view `finished_requests`). So for every request the ledger's settled tokens
are the journal's, and its settle (keyed by the request) says it was journaled.

A request no API reported (its process died mid-stream, or its window's workflow never
started) is journaled the same way from the engine worker's record of it
(journal/served.py), by the quota reconciler's sweep; whichever of the two comes second
finds the request settled and leaves it.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio import activity

from journal import ledger, served
from journal.events import NewEvent, append
from protocol import keys
from protocol.events import EventType
from protocol.temporal import InteractiveInput, JournalRequestInput, RequestOutcome, RequestWindowInput

log = logging.getLogger(__name__)


class RequestActivities:
    def __init__(self, db: AsyncEngine):
        self.db = db

    @activity.defn
    async def journal_window(self, inp: RequestWindowInput) -> int:
        """Every request of the window, in one transaction. How many this call journaled
        (the others were journaled already: by an earlier attempt, or from their engines'
        records because their outcomes came too late)."""
        outcomes = [(dataclasses.replace(r, outcome=None), r.outcome) for r in inp.requests if r.outcome is not None]
        async with self.db.begin() as conn:
            done = await journal_outcomes(conn, outcomes)
        if late := sum(1 for r, _ in outcomes if keys.request(r.request_id) not in done):
            activity.logger.warning("%d of %d requests of a window from %s were journaled before this attempt "
                                    "(from their engines' records, or by an earlier attempt)", late, len(outcomes),
                                    inp.holder)
        return len(done)

    @activity.defn
    async def journal_request(self, inp: JournalRequestInput) -> None:
        """One request (the workflow older APIs started per request)."""
        async with self.db.begin() as conn:
            if not await journal_outcomes(conn, [(inp.request, inp.outcome)]):
                # Journaled already, from the engine's record: this outcome came too late.
                activity.logger.warning("request %s was journaled from its engine's record before its outcome came",
                                        inp.request.request_id)


async def journal_outcomes(conn: AsyncConnection, outcomes: list[tuple[InteractiveInput, RequestOutcome]]) -> set[str]:
    """In the caller's transaction: settle each in the ledger (writing its reservation if
    the API's flusher has not), and journal the outcomes of those this call settled, one
    `request_finished` event per tenant. A request already settled is left as it is: its
    settle's key is the request's, so each is journaled once. The subjects settled now."""
    done = await ledger.settle_all(conn, [ledger_rows(r, outcome) for r, outcome in outcomes])
    by_tenant: dict[str, list[dict[str, Any]]] = {}
    for r, outcome in outcomes:
        if keys.request(r.request_id) in done:
            payload = dict(dataclasses.asdict(dataclasses.replace(r, outcome=None)), **dataclasses.asdict(outcome))
            payload.pop("outcome", None)  # the workflow's input carries it; the event has its fields
            by_tenant.setdefault(r.tenant, []).append(payload)
    events = []
    for tenant, requests in by_tenant.items():
        stream = keys.finished_records(tenant, uuid.uuid4().hex[:16])
        events.append(NewEvent(stream, EventType.REQUEST_FINISHED, dict(requests=requests), stream, tenant))
    await append(conn, events)
    return done


async def account_unreported(db: AsyncEngine, after_s: float) -> int:
    """Journal and settle the requests engines served over `after_s` ago that no API
    reported; how many."""
    async with db.connect() as conn:
        records = await served.unreported(conn, after_s)
    done = 0
    for record in records:
        try:
            request, outcome = from_engine(record)
        except (KeyError, TypeError) as err:  # one unreadable record must not hold up the rest
            log.error("cannot account for the engine's record %s (%s): %r", record.get("request_id"), err, record)
            continue
        async with db.begin() as conn:
            done += len(await journal_outcomes(conn, [(request, outcome)]))
    return done


def from_engine(record: dict[str, Any]) -> tuple[InteractiveInput, RequestOutcome]:
    """The request and its outcome as the engine recorded them; `abandoned`: no API
    reported it. Its settle closes the reservation in the ledger, whatever it held."""
    names = {f.name for f in dataclasses.fields(InteractiveInput)}
    request = InteractiveInput(**{k: v for k, v in record.items() if k in names})
    return request, RequestOutcome("abandoned", record["completion_tokens"], record.get("finish_reason"))


def ledger_rows(r: InteractiveInput, outcome: RequestOutcome) -> tuple[ledger.Entry, ledger.Entry | None]:
    """(the settle row, the reservation row if the request was admitted through one)."""
    subject = keys.request(r.request_id)
    used = ledger.Entry(ledger.SETTLE, subject, r.tenant, r.model, r.tier, r.prompt_tokens,
                        outcome.completion_tokens, r.holder)
    reservation = None
    if r.reserved_input is not None and r.reserved_output is not None:
        at = ledger.timestamp(r.admitted_at) if r.admitted_at is not None else None
        reservation = ledger.Entry(ledger.RESERVE, subject, r.tenant, r.model, r.tier, r.reserved_input,
                                   r.reserved_output, r.holder, at)
    return used, reservation
