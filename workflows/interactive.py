"""Interactive requests: a durable record of each, kept off its token path, by the window.

The API streams tokens straight from the engine worker. Each API process gathers the
requests that ended in a window (api/services/settlement.py) and starts one
`RequestWindow` workflow (on the control worker) carrying them with their outcomes; its
local activity journals them all in one transaction. Two billed Temporal actions per
window, whatever it holds, and none of it runs while any token is streaming. A request
whose API process dies before its window starts is journaled by the quota reconciler
from the engine worker's record of it (journal/served.py).

`InteractiveRequest`, one workflow per request, is what earlier APIs started (after the
request ended, with its outcome in the input; earlier still mid-stream, the outcome coming
by the `finished` signal or the abandon timer): kept so their histories replay and their
runs finish.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.interactive import RequestActivities
    from protocol.temporal import InteractiveInput, JournalRequestInput, RequestOutcome, RequestWindowInput

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


# Unsandboxed, like the above: it imports nothing and does no I/O.
@workflow.defn(name="RequestWindow", sandboxed=False)
class RequestWindowWorkflow:
    @workflow.run
    async def run(self, inp: RequestWindowInput) -> int:
        return await workflow.execute_local_activity_method(
            RequestActivities.journal_window, inp, start_to_close_timeout=timedelta(seconds=60),
        )
