"""Journal an interactive request's outcome: who, which tier, where, how many tokens.

The same transaction settles the request in the quota ledger: its reservation (unless the
API's flusher has written it already), a settle row of exactly the tokens the event
records (prompt_tokens, completion_tokens), and the refund of what the reservation held
beyond them. So for every request the ledger's settled tokens are the journal's.

A request no API reported (its process died mid-stream) is journaled the same way from
the engine worker's record of it (journal/served.py), by the quota reconciler's sweep;
whichever of the two comes second finds the outcome journaled and leaves it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio import activity

from journal import ledger, served
from journal.events import IdempotencyConflict, NewEvent, append_one
from protocol import keys
from protocol.events import EventType
from protocol.temporal import InteractiveInput, JournalRequestInput, RequestOutcome

log = logging.getLogger(__name__)


class RequestActivities:
    def __init__(self, db: AsyncEngine):
        self.db = db

    @activity.defn
    async def journal_request(self, inp: JournalRequestInput) -> None:
        try:
            async with self.db.begin() as conn:
                await journal_outcome(conn, inp.request, inp.outcome)
        except IdempotencyConflict:
            # Journaled already, from the engine's record: this outcome came too late.
            activity.logger.warning("request %s was journaled from its engine's record before its outcome came",
                                    inp.request.request_id)


async def journal_outcome(conn: AsyncConnection, r: InteractiveInput, outcome: RequestOutcome) -> None:
    payload = dict(dataclasses.asdict(dataclasses.replace(r, outcome=None)), **dataclasses.asdict(outcome))
    payload.pop("outcome", None)  # the workflow's input carries it; the event has its fields
    stream = keys.request(r.request_id)
    await append_one(conn, NewEvent(stream, EventType.REQUEST_FINISHED, payload, f"{stream}:finished", r.tenant))
    used, reservation = ledger_rows(r, outcome)
    await ledger.settle(conn, used, reservation)


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
        try:
            async with db.begin() as conn:
                await journal_outcome(conn, request, outcome)
            done += 1
        except IdempotencyConflict:
            pass  # its workflow journaled it meanwhile
    return done


def from_engine(record: dict[str, Any]) -> tuple[InteractiveInput, RequestOutcome]:
    """The request and its outcome as the engine recorded them; `abandoned`: no API
    reported it. The reservation is left to the ledger (settle refunds what it held)."""
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
