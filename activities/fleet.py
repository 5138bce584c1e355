"""The fleet controller's two side effects: read the engines' reports, apply its decisions.

Both run as local activities of the controller's workflow (on the control worker): a
tick costs no task dispatch.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from journal import engine_registry
from journal.events import NewEvent, append
from journal.tenant_store import SYSTEM
from protocol.engine_wire import EngineStats
from protocol.fleet import EngineReport
from protocol.temporal import ApplyFleetInput, ObserveFleetInput


class FleetActivities:
    def __init__(self, db: AsyncEngine):
        self.db = db

    @activity.defn
    async def observe_fleet(self, inp: ObserveFleetInput) -> list[EngineReport]:
        async with self.db.connect() as conn:
            rows = await engine_registry.live(conn, within_s=inp.stale_s)
        return [_report(r) for r in rows]

    @activity.defn
    async def apply_fleet(self, inp: ApplyFleetInput) -> None:
        # One transaction: the caps and the events that explain them land together.
        async with self.db.begin() as conn:
            await engine_registry.set_caps(conn, inp.caps)
            await append(conn, [NewEvent(e.stream, e.type, e.payload, e.key, SYSTEM) for e in inp.events])


def _report(row: dict) -> EngineReport:
    s = EngineStats.from_json(row["stats"])
    return EngineReport(
        id=row["id"], pool=row["model"], max_seqs=s.max_seqs, interactive=s.interactive, batch=s.batch,
        running=s.running, waiting=s.waiting, kv_cache_usage=s.kv_cache_usage, fleet_cap=row.get("batch_cap"),
        batch_queued=s.batch_queued,
    )
