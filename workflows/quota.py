"""The quota reconciler: one long-lived workflow per control queue that keeps admission's
view of usage current, off the request path.

Every tick (`admission_refresh_s`) one local activity (no task dispatch) expires the
reservations of admitting processes not seen for `admission_holder_ttl_s` and folds the
ledger into `quota_usage` (journal/ledger.py), which every API process re-reads as often.
It continues as new every `ticks_per_run` ticks, so its history stays a few thousand
events. Several control workers may poll the queue; the fixed workflow id keeps one
reconciler running, and the fold takes an advisory lock besides.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities.quota import QuotaActivities
    from protocol.temporal import QuotaInput, ReconcileInput

QUOTA_ID = "quota-reconciler"
_LOCAL: dict[str, Any] = dict(start_to_close_timeout=timedelta(seconds=30),
                              retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)))


@workflow.defn(name="QuotaReconciler")
class QuotaReconciler:
    @workflow.run
    async def run(self, inp: QuotaInput) -> None:
        for _ in range(inp.ticks_per_run):
            began = workflow.now()
            await workflow.execute_local_activity_method(QuotaActivities.reconcile_quota,
                                                         ReconcileInput(inp.holder_ttl_s, inp.tick_s), **_LOCAL)
            # A fixed rate: the tick's own duration does not stretch the period (the
            # admission staleness bound counts one period per fold).
            took = (workflow.now() - began).total_seconds()
            await workflow.sleep(max(0.001, inp.tick_s - took))
        workflow.continue_as_new(inp)
