"""What the engines served, for the requests no API reported.

An interactive request is journaled by its API process's window, from the outcome that
process saw (`request_finished`, api/services/settlement.py, activities/interactive.py). An
API process that dies mid-stream, or before its window's workflow starts, reports nothing.
So each engine worker also records every request it served, when its stream
ends (tenant, tier, prompt and completion tokens as vLLM counted them), and journals the
records on its checkpointer's ticks: one `request_served` event per tenant a tick, with
the list of them (`ServedRecords`), nothing on the token path. The quota reconciler
sweeps these (the view `served_requests`, migration 0025, a row per request): a request
served more than `after_s` ago with no settle in the ledger is journaled from the
engine's record (`abandoned`: no API reported it) and settled in the same transaction, as
its window would have. Whoever settles first wins (the settle's key is the request's);
the other finds it settled and leaves it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.events import NewEvent
from protocol import keys
from protocol.events import EventType

SERVED = EventType.REQUEST_SERVED
LOOKBACK_S = 600  # each record is looked at for this long after it ages past `after_s`


log = logging.getLogger(__name__)


class ServedRecords:
    """An engine worker's records of what it served, journaled on its checkpointer's
    ticks (journal/checkpointer.py tracks it): one event per tenant a tick."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        self._records.append(record)

    def due(self) -> list[NewEvent]:
        records, self._records = self._records, []
        by_tenant: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            by_tenant.setdefault(r.get("tenant") or "default", []).append(r)
        out = []
        for tenant, requests in by_tenant.items():
            stream = keys.served_records(self.engine_id, uuid.uuid4().hex[:16])
            out.append(NewEvent(stream, SERVED, dict(engine_id=self.engine_id, requests=requests), stream, tenant))
        return out

    def committed(self, event: asyncio.Future) -> None:
        event.add_done_callback(_said)


def _said(f: asyncio.Future) -> None:
    """Nobody awaits these commits: say so if one fails."""
    if not f.cancelled() and f.exception() is not None:
        log.warning("could not journal what this engine served: %s", f.exception())


_UNREPORTED = text(
    """
    SELECT s.record FROM served_requests s
     WHERE s.committed_at < now() - make_interval(secs => :after_s)
       AND s.committed_at >= now() - make_interval(secs => :after_s + :lookback_s)
       AND NOT EXISTS (SELECT 1 FROM ledger l WHERE l.idempotency_key = 'settle:request:' || s.request_id)
     ORDER BY s.committed_at, s.position
     LIMIT :limit
    """
)


async def unreported(conn: AsyncConnection, after_s: float, limit: int = 1000) -> list[dict[str, Any]]:
    """The engines' records of requests served over `after_s` ago that nobody journaled."""
    rows = await conn.execute(_UNREPORTED, dict(after_s=after_s, lookback_s=LOOKBACK_S, limit=limit))
    return [r[0] for r in rows]

