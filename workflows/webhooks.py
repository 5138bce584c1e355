"""Completion webhooks: a job's workflow, once its terminal status is journaled, starts
`WebhookDelivery` as an abandoned child (`announce`), on the control worker's webhook
queue, with an id derived from the job (a second start is refused: one per job).

The child raises the job's event (an activity reads the status from the journal and
journals the event once, with the endpoints subscribed then), delivers it to each
endpoint side by side, each delivery one activity retried by Temporal with exponential
backoff until a 2xx or `give_up_after_s`, and journals an endpoint it gave up on.
Deterministic orchestration only: the retry settings come back from the raise, which runs
where the settings are.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.webhooks import WebhookActivities
    from protocol import keys, search
    from protocol.temporal import AbandonInput, DeliverInput, WebhookInput, WebhookPlan
    from protocol.webhooks import webhook_queue

# The patch id guarding the jobs' workflows' new last step (workflow.patched): histories
# recorded before it replay without it.
PATCH = "webhooks-on-terminal-status"
STEP: dict[str, Any] = dict(
    start_to_close_timeout=timedelta(minutes=1),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)


@workflow.defn(name="WebhookDelivery")
class WebhookDelivery:
    @workflow.run
    async def run(self, inp: WebhookInput) -> int:
        """Delivers to each endpoint of the event; returns how many got it."""
        plan: WebhookPlan = await workflow.execute_activity_method(WebhookActivities.raise_webhook, inp, **STEP)
        if not plan.endpoints:
            return 0
        retry = RetryPolicy(initial_interval=timedelta(seconds=plan.initial_interval_s), backoff_coefficient=2.0,
                            maximum_interval=timedelta(seconds=plan.max_interval_s), maximum_attempts=0)
        handles = [
            workflow.start_activity_method(
                WebhookActivities.deliver_webhook, DeliverInput(plan.event_id, endpoint),
                activity_id=f"deliver-{endpoint}",
                start_to_close_timeout=timedelta(seconds=plan.attempt_timeout_s + 30),
                schedule_to_close_timeout=timedelta(seconds=plan.give_up_after_s),
                retry_policy=retry,
            )
            for endpoint in plan.endpoints
        ]
        results = await asyncio.gather(*handles, return_exceptions=True)
        got = 0
        for endpoint, result in zip(plan.endpoints, results, strict=True):
            if result is True:
                got += 1
            elif isinstance(result, ActivityError):
                cause = result.cause
                detail = cause.message if isinstance(cause, ApplicationError) else type(cause).__name__
                await workflow.execute_activity_method(
                    WebhookActivities.abandon_webhook,
                    AbandonInput(plan.event_id, endpoint, "retries_exhausted", detail), **STEP)
            elif isinstance(result, BaseException):
                raise result
        return got


async def announce(kind: str, job_id: str, job_stream: str) -> None:
    """From a job's workflow once it has ended: start the delivery of its event (guarded
    by PATCH, so histories recorded before it still replay)."""
    if not workflow.patched(PATCH):
        return
    info = workflow.info()
    # Only the kind: a tenant's workflows listed by BallastTenant are its jobs, not these.
    searchable = info.typed_search_attributes.get(search.KIND) is not None
    try:
        await workflow.start_child_workflow(
            WebhookDelivery.run, WebhookInput(kind, job_id),
            id=keys.webhook_delivery(job_stream),
            task_queue=webhook_queue(info.task_queue),
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            search_attributes=search.attributes("webhook") if searchable else None,
        )
    except WorkflowAlreadyStartedError:
        pass  # started already (a reset run of the job's workflow): it delivers
