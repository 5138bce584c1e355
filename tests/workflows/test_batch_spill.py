"""A fenced tenant's batch spills inside its fence: on the real Temporal dev server, the
batch workflow starts on its first region's engine queue, where no engine worker polls (the
region is down); once a group has waited `spill_after_s` unclaimed, the next region's
queue takes it and every item completes there. The history replays."""

from __future__ import annotations

import uuid

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from protocol.temporal import (
    BatchInput,
    FinalizeInput,
    GenerateInput,
    GenerateResult,
    PendingInput,
    ValidateInput,
    ValidateResult,
)
from workflows.batch import BatchWorkflow

ITEMS = 40


class Journal:
    """The batch's items, in memory: what the activities read and write."""

    def __init__(self) -> None:
        self.pending = set(range(ITEMS))
        self.ran_on: dict[int, str] = {}

    @activity.defn(name="validate_batch")
    async def validate_batch(self, inp: ValidateInput) -> ValidateResult:
        return ValidateResult(ITEMS, False)

    @activity.defn(name="pending_items")
    async def pending_items(self, inp: PendingInput) -> list[int]:
        return sorted(i for i in self.pending if i > inp.after_idx)[: inp.limit]

    @activity.defn(name="generate")
    async def generate(self, inp: GenerateInput) -> list[GenerateResult]:
        for idx in inp.idxs:
            assert idx not in self.ran_on, f"item {idx} ran twice"
            self.ran_on[idx] = activity.info().task_queue
            self.pending.discard(idx)
        return [GenerateResult("completed", idx, 1) for idx in inp.idxs]

    @activity.defn(name="finalize_batch")
    async def finalize_batch(self, inp: FinalizeInput) -> str:
        return inp.status


async def test_a_fenced_batch_moves_to_the_next_region_when_its_own_claims_nothing(temporal_address):
    client = await Client.connect(temporal_address)
    tag = uuid.uuid4().hex[:8]
    control, eu, us = f"control-{tag}", f"engine-{tag}@eu", f"engine-{tag}@us"
    journal = Journal()
    inp = BatchInput(f"batch_{tag}", expires_at=4_000_000_000, engine_queue=eu, concurrency=16, group_size=8,
                     spill_queues=[us], spill_after_s=1.0)
    async with Worker(client, task_queue=control, workflows=[BatchWorkflow],
                      activities=[journal.validate_batch, journal.pending_items, journal.finalize_batch]), \
            Worker(client, task_queue=us, activities=[journal.generate]):  # nothing polls eu
        result = await client.execute_workflow(BatchWorkflow.run, inp, id=f"batch-{tag}", task_queue=control)

    assert result == "completed"
    assert sorted(journal.ran_on) == list(range(ITEMS)) and set(journal.ran_on.values()) == {us}
    history = await client.get_workflow_handle(f"batch-{tag}").fetch_history()
    timed_out = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT]
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes.task_queue.name for e in history.events
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
    assert timed_out and all(scheduled[e.activity_task_timed_out_event_attributes.scheduled_event_id] == eu
                             for e in timed_out)  # only eu's groups waited, then moved
    await Replayer(workflows=[BatchWorkflow]).replay_workflow(history)


async def test_an_unfenced_batch_waits_on_its_queue_with_no_timeout(temporal_address):
    """No spill queues: the pool's queue, no schedule-to-start bound (a batch waits for
    capacity however long its window allows), as before fences could spill."""
    client = await Client.connect(temporal_address)
    tag = uuid.uuid4().hex[:8]
    control, pool = f"control-{tag}", f"engine-{tag}"
    journal = Journal()
    inp = BatchInput(f"batch_{tag}", expires_at=4_000_000_000, engine_queue=pool, concurrency=16, group_size=8)
    async with Worker(client, task_queue=control, workflows=[BatchWorkflow],
                      activities=[journal.validate_batch, journal.pending_items, journal.finalize_batch]), \
            Worker(client, task_queue=pool, activities=[journal.generate]):
        assert await client.execute_workflow(BatchWorkflow.run, inp, id=f"batch-{tag}", task_queue=control) == \
            "completed"
    history = await client.get_workflow_handle(f"batch-{tag}").fetch_history()
    scheduled = [e.activity_task_scheduled_event_attributes for e in history.events
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "generate"]
    assert scheduled and all(a.task_queue.name == pool and not a.schedule_to_start_timeout.ToTimedelta()
                             for a in scheduled)
