"""The quota reconciler's side effect: expire dead holders' reservations, fold the ledger,
and now and then journal the requests no API reported (activities/interactive.py) and
remove expired files (journal/batch_store.py), the latter in the background, one sweep at
a time, so that deletions on an object store never stretch a tick.

A local activity of `workflows/quota.py` on the control worker; one transaction per tick.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from activities.interactive import account_unreported
from journal import batch_store, fold
from protocol.temporal import ReconcileInput, ReconcileResult
from storage.objects import ObjectStore

SWEEP_EVERY_S = 10.0
FILES_EVERY_S = 60.0

log = logging.getLogger(__name__)


class QuotaActivities:
    def __init__(self, db: AsyncEngine, unreported_after_s: float = 60.0, store: ObjectStore | None = None):
        self.db = db
        self.unreported_after_s = unreported_after_s
        self.store = store  # expired files are removed from it (None: not here)
        self._next_sweep = 0.0
        self._next_files = 0.0
        self._files: asyncio.Task | None = None

    @activity.defn
    async def reconcile_quota(self, inp: ReconcileInput) -> ReconcileResult:
        t0 = time.monotonic()
        async with self.db.begin() as conn:
            folded = await fold.reconcile(conn, inp.holder_ttl_s)
        if t0 >= self._next_sweep:
            self._next_sweep = t0 + min(SWEEP_EVERY_S, self.unreported_after_s)
            if n := await account_unreported(self.db, self.unreported_after_s):
                activity.logger.warning("journaled %d requests no API reported, from their engines' records", n)
        if self.store is not None and t0 >= self._next_files and (self._files is None or self._files.done()):
            self._next_files = t0 + FILES_EVERY_S
            self._files = asyncio.create_task(self._sweep_files(self.store))
        took = time.monotonic() - t0
        if folded.expired:
            activity.logger.info("expired %d reservations of holders not seen for %ss", len(folded.expired),
                                 inp.holder_ttl_s)
        if took > inp.tick_s / 2:  # the staleness bound assumes a tick takes far less than its period
            activity.logger.warning("the quota fold took %.2fs of its %.2fs period", took, inp.tick_s)
        return ReconcileResult(folded.rows, len(folded.expired))

    async def _sweep_files(self, store: ObjectStore) -> None:
        try:
            await batch_store.sweep_expired_files(self.db, store)
        except Exception as err:  # the next sweep takes what this one left
            log.warning("could not remove expired files: %s", err)
