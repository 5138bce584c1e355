"""What the engines served, for the requests no API reported.

An interactive request is journaled by its API process's window, from the outcome that
process saw (`request_finished`, api/services/settlement.py, activities/interactive.py). An
API process that dies mid-stream, or before its window's workflow starts, reports nothing.
So each engine worker also records every request it served, when its stream
ends (`request_served`, stream `served:<id>`: tenant, tier, prompt and completion tokens
as vLLM counted them), queued on its checkpointer: one multi-row append a tick, nothing on
the token path. The quota reconciler sweeps these: a request served more than
`after_s` ago with no `request_finished` is journaled from the engine's record
(`abandoned`: no API reported it) and settled in the ledger in the same transaction, as
its window would have. Whoever journals first wins; the other finds the key taken.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.events import NewEvent
from protocol import keys
from protocol.events import EventType

SERVED = EventType.REQUEST_SERVED
LOOKBACK_S = 600  # each record is looked at for this long after it ages past `after_s`


def served_event(engine_id: str, record: dict[str, Any]) -> NewEvent:
    rid = record["request_id"]
    return NewEvent(keys.served(rid), SERVED, dict(record, engine_id=engine_id), keys.served(rid),
                    record.get("tenant") or "default")


_UNREPORTED = text(
    """
    SELECT s.payload FROM events s
     WHERE s.type = 'request_served'
       AND s.committed_at < now() - make_interval(secs => :after_s)
       AND s.committed_at >= now() - make_interval(secs => :after_s + :lookback_s)
       AND NOT EXISTS (SELECT 1 FROM events f
                        WHERE f.idempotency_key = 'request:' || (s.payload->>'request_id') || :finished)
     ORDER BY s.committed_at
     LIMIT :limit
    """
)


async def unreported(conn: AsyncConnection, after_s: float, limit: int = 1000) -> list[dict[str, Any]]:
    """The engines' records of requests served over `after_s` ago that nobody journaled."""
    rows = await conn.execute(_UNREPORTED, dict(after_s=after_s, lookback_s=LOOKBACK_S, limit=limit,
                                                   finished=":finished"))
    return [r[0] for r in rows]

