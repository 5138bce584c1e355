"""The quota reconciler's side effect: expire dead holders' reservations, fold the ledger,
and now and then journal the requests no API reported (activities/interactive.py).

A local activity of `workflows/quota.py` on the control worker; one transaction per tick.
"""

from __future__ import annotations

import time

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from activities.interactive import account_unreported
from journal import fold
from protocol.temporal import ReconcileInput, ReconcileResult

SWEEP_EVERY_S = 10.0


class QuotaActivities:
    def __init__(self, db: AsyncEngine, unreported_after_s: float = 60.0):
        self.db = db
        self.unreported_after_s = unreported_after_s
        self._next_sweep = 0.0

    @activity.defn
    async def reconcile_quota(self, inp: ReconcileInput) -> ReconcileResult:
        t0 = time.monotonic()
        async with self.db.begin() as conn:
            folded = await fold.reconcile(conn, inp.holder_ttl_s)
        if t0 >= self._next_sweep:
            self._next_sweep = t0 + min(SWEEP_EVERY_S, self.unreported_after_s)
            if n := await account_unreported(self.db, self.unreported_after_s):
                activity.logger.warning("journaled %d requests no API reported, from their engines' records", n)
        took = time.monotonic() - t0
        if folded.expired:
            activity.logger.info("expired %d reservations of holders not seen for %ss", len(folded.expired),
                                 inp.holder_ttl_s)
        if took > inp.tick_s / 2:  # the staleness bound assumes a tick takes far less than its period
            activity.logger.warning("the quota fold took %.2fs of its %.2fs period", took, inp.tick_s)
        return ReconcileResult(folded.rows, len(folded.expired))
