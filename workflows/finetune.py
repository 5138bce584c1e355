"""A fine-tuning job: validate its file, train chunk by chunk, end with its adapter.
Deterministic orchestration only.

Each chunk is one activity on an engine worker (activities/finetune.py): it resumes from
the job's last good checkpoint, trains `chunk_steps` steps, checkpoints and journals. So
a chunk that dies (worker killed, heartbeat lost) is retried from the last checkpoint on
any worker; a chunk the engine preempts for interactive work checkpoints and returns
early, and the next one resumes it. `pause` and `cancel` stop the running chunk the same
way (it checkpoints first); `resume` starts the next. After `chunks_per_run` chunks the
workflow continues as new, so a long job's history stays small.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import Priority, RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError

with workflow.unsafe.imports_passed_through():
    from activities.finetune import FineTuneActivities
    from policy.promises import BATCH_PRIORITY_KEY
    from protocol import keys
    from protocol.temporal import (
        FineTuneInput,
        FineTuneRef,
        FineTuneStatusInput,
        TrainChunkInput,
        TrainChunkResult,
        ValidateTrainingResult,
    )
    from workflows.batch import GENERATION_ATTEMPTS, INPUT_STEP
    from workflows.reasons import told
    from workflows.webhooks import announce

STATUS_STEP: dict[str, Any] = dict(
    start_to_close_timeout=timedelta(minutes=1),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)


@workflow.defn(name="FineTune")
class FineTuneWorkflow:
    def __init__(self) -> None:
        self._paused = False
        self._cancel = False

    @workflow.signal
    def pause(self) -> None:
        self._paused = True

    @workflow.signal
    def resume(self) -> None:
        self._paused = False

    @workflow.signal
    def cancel(self) -> None:
        self._cancel = True

    @workflow.run
    async def run(self, inp: FineTuneInput) -> str:
        status = await self._run(inp)
        # Its terminal status is journaled: tell the tenant's webhooks (workflows/webhooks.py).
        await announce("fine_tuning.job", inp.job_id, keys.ftjob(inp.job_id))
        return status

    async def _run(self, inp: FineTuneInput) -> str:
        self._paused = self._paused or inp.paused
        self._cancel = self._cancel or inp.cancel_requested

        # 1. Validate the training file once; a bad one fails the job with line errors.
        if not inp.validated:
            checked: ValidateTrainingResult = await workflow.execute_activity_method(
                FineTuneActivities.validate_training_file, FineTuneRef(inp.job_id), **INPUT_STEP)
            if checked.failed:
                return "failed"
            await self._status(inp, "running")

        # 2. Chunks until the last step, a cancel, or this run's share of chunks.
        for _ in range(inp.chunks_per_run):
            if self._cancel:
                return await self._status(inp, "cancelled")
            if self._paused:
                await self._status(inp, "paused")
                await workflow.wait_condition(lambda: not self._paused or self._cancel)
                if self._cancel:
                    continue
                await self._status(inp, "running")
            try:
                result = await self._chunk(inp)
            except ActivityError as err:
                return await self._status(inp, "failed", f"Training failed: {told(err)}")
            if result is not None and result.done:
                return await self._status(inp, "succeeded")
            if result is not None and result.wait_until:
                # The tenant's tokens of the day are spent (its job events say so): the next
                # chunk waits for the next UTC day; a pause or a cancel ends the wait.
                wait = max(1.0, result.wait_until - workflow.now().timestamp())
                try:
                    await workflow.wait_condition(lambda: self._paused or self._cancel, timeout=wait)
                except TimeoutError:
                    pass
        workflow.continue_as_new(replace(inp, validated=True, paused=self._paused, cancel_requested=self._cancel))

    async def _chunk(self, inp: FineTuneInput) -> TrainChunkResult | None:
        """One chunk; None when a pause or cancel stopped it (it checkpointed first)."""
        handle = workflow.start_activity_method(
            FineTuneActivities.train_chunk,
            TrainChunkInput(inp.job_id, inp.chunk_steps, inp.checkpoint_overhead, inp.chunk_max_s),
            task_queue=inp.engine_queue,
            start_to_close_timeout=timedelta(hours=6),
            heartbeat_timeout=timedelta(seconds=inp.heartbeat_timeout_s),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                                     maximum_attempts=GENERATION_ATTEMPTS),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            # Training yields to interactive work as batch does, and shares engines between
            # tenants by weight.
            priority=Priority(priority_key=BATCH_PRIORITY_KEY, fairness_key=inp.tenant,
                              fairness_weight=inp.fairness_weight),
        )
        await workflow.wait_condition(lambda: handle.done() or self._paused or self._cancel)
        if not handle.done():
            handle.cancel()
        try:
            return await handle
        except ActivityError as err:
            if isinstance(err.cause, CancelledError):
                return None
            raise

    async def _status(self, inp: FineTuneInput, status: str, message: str = "") -> str:
        """Journal the job's status (and, at the end, its results); returns it."""
        return await workflow.execute_activity_method(
            FineTuneActivities.fine_tune_status, FineTuneStatusInput(inp.job_id, status, message), **STATUS_STEP)
