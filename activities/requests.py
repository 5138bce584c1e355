"""Journal an interactive request's outcome: who, which tier, where, how many tokens."""

from __future__ import annotations

import dataclasses

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from journal.events import NewEvent, append_one
from workflows.inputs import JournalRequestInput


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
