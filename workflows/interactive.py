"""One interactive request: a durable record of it, kept off its token path.

The API streams tokens straight from the engine worker; this workflow is started (in the
background, once the engine has accepted the request and its first token is on its way;
it runs on the control worker) and learns the outcome from one signal, then journals it
with a local activity. Three billed Temporal actions per request, whatever its length:
start, signal, local activity; a fourth, the abandon timer, when the workflow's first task
runs before the outcome is in. A request whose API replica dies mid-stream is journaled
by the quota reconciler from the engine worker's record of it (journal/served.py), long
before the timer fires; the timer's own outcome then finds it journaled.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.inputs import InteractiveInput, JournalRequestInput, RequestOutcome

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
        try:
            await workflow.wait_condition(lambda: self._outcome is not None, timeout=ABANDON_AFTER)
        except TimeoutError:
            self._outcome = RequestOutcome(status="abandoned")
        outcome = self._outcome
        assert outcome is not None  # the signal set it, or the timeout did
        await workflow.execute_local_activity(
            "journal_request", JournalRequestInput(inp, outcome), start_to_close_timeout=timedelta(seconds=30)
        )
        return outcome.status
