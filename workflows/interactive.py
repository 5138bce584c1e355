"""One interactive request: a durable record of it, kept off its token path.

The API streams tokens straight from the engine worker. Once the request has ended it
starts this workflow (on the control worker) with the outcome in its input; the workflow
journals it with a local activity. Two billed Temporal actions per request, whatever its
length, and none of its bookkeeping runs while any token of it is streaming. A request
whose API process dies before that is journaled by the quota reconciler from the engine
worker's record of it (journal/served.py).

Older APIs started the workflow mid-stream with no outcome (their histories still replay):
it then comes by the `finished` signal, or the abandon timer journals the request abandoned.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.interactive import RequestActivities
    from protocol.temporal import InteractiveInput, JournalRequestInput, RequestOutcome

ABANDON_AFTER = timedelta(hours=1)


# Unsandboxed: one runs per request, and the sandbox's per-run module re-import costs
# milliseconds of CPU each. It imports nothing and does no I/O.
@workflow.defn(name="InteractiveRequest", sandboxed=False)
class InteractiveWorkflow:
    def __init__(self) -> None:
        self._outcome: RequestOutcome | None = None

    @workflow.signal
    def finished(self, outcome: RequestOutcome) -> None:
        self._outcome = outcome

    @workflow.run
    async def run(self, inp: InteractiveInput) -> str:
        if inp.outcome is not None:
            self._outcome = inp.outcome
        else:
            try:
                await workflow.wait_condition(lambda: self._outcome is not None, timeout=ABANDON_AFTER)
            except TimeoutError:
                self._outcome = RequestOutcome(status="abandoned")
        outcome = self._outcome
        assert outcome is not None  # the input, the signal or the timeout set it
        await workflow.execute_local_activity_method(
            RequestActivities.journal_request, JournalRequestInput(dataclasses.replace(inp, outcome=None), outcome),
            start_to_close_timeout=timedelta(seconds=30),
        )
        return outcome.status
