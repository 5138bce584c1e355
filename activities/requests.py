"""Journal an interactive request's outcome: who, which tier, where, how many tokens.

The same transaction settles the request in the quota ledger: its reservation (unless the
API's flusher has written it already), a settle row of exactly the tokens the event
records (prompt_tokens, completion_tokens), and the refund of what the reservation held
beyond them. So for every request the ledger's settled tokens are the journal's.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from journal import ledger
from journal.events import NewEvent, append_one
from workflows.inputs import InteractiveInput, JournalRequestInput, RequestOutcome


class RequestActivities:
    def __init__(self, db: AsyncEngine):
        self.db = db

    @activity.defn
    async def journal_request(self, inp: JournalRequestInput) -> None:
        r = inp.request
        payload = dict(dataclasses.asdict(r), **dataclasses.asdict(inp.outcome))
        stream = f"request:{r.request_id}"
        async with self.db.begin() as conn:
            await append_one(conn, NewEvent(stream, "request_finished", payload, f"{stream}:finished", r.tenant))
            used, reservation = ledger_rows(r, inp.outcome)
            await ledger.settle(conn, used, reservation)


def ledger_rows(r: InteractiveInput, outcome: RequestOutcome) -> tuple[ledger.Entry, ledger.Entry | None]:
    """(the settle row, the reservation row if the request was admitted through one)."""
    subject = ledger.request_subject(r.request_id)
    used = ledger.Entry(ledger.SETTLE, subject, r.tenant, r.model, r.tier, r.prompt_tokens,
                        outcome.completion_tokens, r.holder)
    reservation = None
    if r.reserved_input is not None and r.reserved_output is not None:
        at = ledger.timestamp(r.admitted_at) if r.admitted_at is not None else None
        reservation = ledger.Entry(ledger.RESERVE, subject, r.tenant, r.model, r.tier, r.reserved_input,
                                   r.reserved_output, r.holder, at)
    return used, reservation
