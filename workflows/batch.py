"""A batch job, from validation to its output files. Deterministic orchestration only.

The workflow never sees a prompt or a token: activities read items from the journal and
write results back, the workflow moves item indices around. Each run handles at most
`items_per_run` items and then continues as new, so a 50,000-item batch keeps every
history small.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

from temporalio import workflow
from temporalio.common import Priority, RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError, TimeoutType
from temporalio.exceptions import TimeoutError as Unclaimed  # the builtin TimeoutError is wait_condition's

with workflow.unsafe.imports_passed_through():
    from activities.batch import BatchActivities
    from activities.generate import GenerationActivities
    from protocol import keys
    from protocol.temporal import (
        BatchInput,
        BatchOutcome,
        FailBatchInput,
        FailItemInput,
        FinalizeInput,
        GenerateInput,
        GenerateResult,
        PendingInput,
        ValidateInput,
        ValidateResult,
    )
    from workflows.reasons import told
    from workflows.webhooks import announce

CONTROL: dict[str, Any] = dict(
    start_to_close_timeout=timedelta(minutes=10),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)
# The steps whose success depends on what the user sent (the file, the results) are
# bounded, and refuse at once what can never succeed (non-retryable): one that keeps
# failing ends the batch `failed` with the reason instead of leaving it in `validating` or
# `finalizing`. ~5 minutes of attempts outlasts a database restart.
INPUT_STEP: dict[str, Any] = dict(
    start_to_close_timeout=timedelta(minutes=10),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                             maximum_attempts=14),
)
# A generation that keeps killing its worker is failed after this many attempts, not forever.
GENERATION_ATTEMPTS = 8


@workflow.defn(name="Batch")
class BatchWorkflow:
    def __init__(self) -> None:
        self._cancel = False
        self._spills = 0  # how many times this run moved to the next queue of the geography

    @workflow.signal
    def cancel(self) -> None:
        self._cancel = True

    @workflow.run
    async def run(self, inp: BatchInput) -> str:
        status = await self._run(inp)
        # Its terminal status is journaled: tell the tenant's webhooks (workflows/webhooks.py).
        await announce("batch", inp.batch_id, keys.batch(inp.batch_id))
        return status

    async def _run(self, inp: BatchInput) -> str:
        self._cancel = self._cancel or inp.cancel_requested
        ref = ValidateInput(inp.batch_id, inp.model)

        # 1. Validate the input file once; a bad file fails the batch with line errors,
        #    a good one puts its items in the journal and the batch in progress.
        if not inp.validated:
            try:
                checked: ValidateResult = await workflow.execute_activity_method(
                    BatchActivities.validate_batch, ref, **INPUT_STEP
                )
            except ActivityError as err:
                return await self._fail(inp.batch_id, "validation_failed",
                                        f"The input file could not be validated: {told(err)}")
            if checked.failed:
                return "failed"

        # 2. Run pending items, `concurrency` at a time, until done, cancelled or expired.
        outcome = await self._run_items(inp)
        if outcome == "continue":
            workflow.continue_as_new(replace(inp, validated=True, cancel_requested=self._cancel, after_idx=self._after))

        # 3. Write the output and error files; the batch reaches its final status.
        #    A cancel that landed after the items finished ends it `cancelled`: finalize
        #    says which status the batch reached.
        try:
            return await workflow.execute_activity_method(
                BatchActivities.finalize_batch, FinalizeInput(inp.batch_id, outcome, self._now()), **INPUT_STEP
            )
        except ActivityError as err:
            return await self._fail(inp.batch_id, "finalization_failed",
                                    f"The results could not be written: {told(err)}")

    async def _fail(self, batch_id: str, code: str, message: str) -> str:
        await workflow.execute_activity_method(BatchActivities.fail_batch, FailBatchInput(batch_id, code, message),
                                        start_to_close_timeout=timedelta(minutes=1),
                                        retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30)))
        return "failed"

    async def _run_items(self, inp: BatchInput) -> BatchOutcome | Literal["continue"]:
        self._after = inp.after_idx
        queue: deque[int] = deque()
        sticky: dict[int, str] = {}  # item → the engine worker's own queue its prefix goes to
        running: dict[int, tuple[workflow.ActivityHandle, list[int], str]] = {}  # by group number: its queue
        groups = started = 0
        exhausted = False
        cancelled_sent = False

        def stopping() -> bool:
            return self._cancel or self._now() >= inp.expires_at

        def room() -> int:
            in_flight = sum(len(idxs) for _, idxs, _ in running.values())
            return min(inp.concurrency - in_flight, inp.items_per_run - started)

        def woken() -> bool:
            return (stopping() and not cancelled_sent) or any(h.done() for h, _, _ in running.values())

        while True:
            # Refill the queue a page ahead of the slots, so engines never wait on us.
            if not exhausted and len(queue) < inp.concurrency and room() > 0 and not stopping():
                page = await self._page(inp, sticky)
                exhausted = not page
                queue.extend(page)
                if page:
                    self._after = max(page)  # a page comes clustered by prompt, not in index order
            while queue and room() > 0 and not stopping():
                # A group: the next items bound for one queue (a worker's own, or "": ours).
                on = sticky.get(queue[0], "")
                idxs: list[int] = []
                while queue and len(idxs) < min(inp.group_size, room()) and sticky.get(queue[0], "") == on:
                    idxs.append(queue.popleft())
                    sticky.pop(idxs[-1], None)  # an unclaimed group comes back for ours
                on = on or self._queue(inp)
                running[groups] = (self._generate(inp, idxs, groups, on), idxs, on)
                groups += 1
                started += len(idxs)
            if not running:
                break
            try:
                await workflow.wait_condition(
                    woken, timeout=None if cancelled_sent else max(1.0, inp.expires_at - self._now()),
                )
            except TimeoutError:
                pass  # the completion window closed: stopping() now says so
            if stopping() and not cancelled_sent:
                cancelled_sent = True
                for h, _, _ in running.values():
                    h.cancel()
            for g in [g for g, (h, _, _) in running.items() if h.done()]:
                handle, idxs, on = running.pop(g)
                # Preempted or unclaimed items go to the front: they go again as soon as there is room.
                queue.extendleft(reversed(await self._settle(inp, idxs, handle, on)))

        if self._cancel:
            return "cancelled"
        if self._now() >= inp.expires_at:
            return "expired"
        # Items queued but not started are still pending in the journal: the next run
        # pages from the first of them.
        if queue:
            self._after = min(queue) - 1
        return "continue" if not exhausted or queue else "completed"

    async def _page(self, inp: BatchInput, sticky: dict[int, str]) -> list[int]:
        """The next page of pending items; those the page places on an engine worker's own
        queue are noted in `sticky`. A batch from before sticky groups gets a bare list."""
        ask = PendingInput(inp.batch_id, self._after, inp.concurrency * 2,
                           queue=self._queue(inp) if inp.sticky_wait_s else "")
        page = await workflow.execute_activity_method(BatchActivities.pending_items, ask, **CONTROL)
        if isinstance(page, list):
            return page
        at = 0
        for count, on in page.runs:
            if on:
                sticky.update(dict.fromkeys(page.idxs[at:at + count], on))
            at += count
        return page.idxs

    def _queue(self, inp: BatchInput) -> str:
        queues = [inp.engine_queue, *inp.spill_queues]
        return queues[self._spills % len(queues)]

    def _shared(self, inp: BatchInput, on: str) -> bool:
        """`on` is one of the batch's own queues, not an engine worker's."""
        return on == inp.engine_queue or on in inp.spill_queues

    def _generate(self, inp: BatchInput, idxs: list[int], group: int, on: str) -> workflow.ActivityHandle:
        if not self._shared(inp, on):
            wait: float | None = inp.sticky_wait_s
        else:
            wait = inp.spill_after_s if inp.spill_queues else None
        return workflow.start_activity_method(
            GenerationActivities.generate,
            GenerateInput(inp.batch_id, idxs),
            task_queue=on,
            activity_id=f"group-{group}",
            schedule_to_start_timeout=timedelta(seconds=wait) if wait else None,
            start_to_close_timeout=timedelta(hours=6),
            heartbeat_timeout=timedelta(seconds=inp.heartbeat_timeout_s),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=1),
                maximum_interval=timedelta(seconds=30),
                maximum_attempts=GENERATION_ATTEMPTS,
            ),
            # Wait for the generations to flush their tokens before we move on.
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            # Behind any higher-priority work on the engine queue; between tenants' batches,
            # shared by weight (matching's fairness), so one tenant's huge batch does not
            # hold every engine until it drains.
            priority=Priority(priority_key=inp.priority_key, fairness_key=inp.tenant,
                              fairness_weight=inp.fairness_weight),
        )

    async def _settle(self, inp: BatchInput, idxs: list[int], handle: workflow.ActivityHandle, on: str) -> list[int]:
        """The items of a finished group that must run again: unclaimed where it waited
        (the next queue of the geography takes them), or preempted (engine workers resume a
        preempted item in place and never return it here; an older worker, mid-upgrade,
        still may)."""
        batch_id = inp.batch_id
        try:
            results: list[GenerateResult] = await handle
        except ActivityError as err:
            if isinstance(err.cause, CancelledError):
                return []  # they stay pending: reported as cancelled or expired
            if isinstance(err.cause, Unclaimed) and err.cause.type == TimeoutType.SCHEDULE_TO_START:
                if not self._shared(inp, on):  # its worker died, hangs or drains: ours takes them
                    workflow.logger.info("batch %s: %s left a group unclaimed %.0f s; the shared queue takes it",
                                         batch_id, on, inp.sticky_wait_s)
                elif on == self._queue(inp):  # not moved on already by another group's wait
                    self._spills += 1
                    workflow.logger.info("batch %s: no engine worker took a group on %s in %.0f s; now %s",
                                         batch_id, on, inp.spill_after_s, self._queue(inp))
                return idxs
            # Out of attempts: the items fail, the batch goes on.
            for idx in idxs:
                await workflow.execute_activity_method(
                    BatchActivities.fail_item,
                    FailItemInput(batch_id, idx,
                                  f"generation failed after {GENERATION_ATTEMPTS} attempts: {told(err)}"),
                    **CONTROL,
                )
            return []
        return [r.idx for r in results if r.status == "preempted"]

    def _now(self) -> float:
        return workflow.now().timestamp()


