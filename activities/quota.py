"""The quota reconciler's side effect: expire dead holders' reservations, fold the ledger.

A local activity of `workflows/quota.py` on the control worker; one transaction per tick.
"""

from __future__ import annotations

import time

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from journal import ledger
from workflows.inputs import ReconcileInput, ReconcileResult


class QuotaActivities:
    def __init__(self, db: AsyncEngine):
        self.db = db

    @activity.defn
    async def reconcile_quota(self, inp: ReconcileInput) -> ReconcileResult:
        t0 = time.monotonic()
        async with self.db.begin() as conn:
            folded = await ledger.reconcile(conn, inp.holder_ttl_s)
        took = time.monotonic() - t0
        if folded.expired:
            activity.logger.info("expired %d reservations of holders not seen for %ss", len(folded.expired),
                                 inp.holder_ttl_s)
        if took > inp.tick_s / 2:  # the staleness bound assumes a tick takes far less than its period
            activity.logger.warning("the quota fold took %.2fs of its %.2fs period", took, inp.tick_s)
        return ReconcileResult(folded.rows, len(folded.expired))
