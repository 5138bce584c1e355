"""Sticky groups, on the real Temporal dev server: a page that places runs of items on
engine workers' own queues sends each run's groups there; a run whose worker is gone (its
queue unpolled) waits `sticky_wait_s`, then the batch's shared queue takes it; items the
page leaves loose go to the shared queue at once. Every item runs once. The history
replays."""

from __future__ import annotations

import uuid

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from protocol.temporal import BatchInput, Page, PendingInput
from tests.workflows.test_batch_spill import ITEMS, Journal
from workflows.batch import BatchWorkflow


class Placed(Journal):
    """The journal, whose pages place items by a fixed plan: index → queue ("": shared)."""

    def __init__(self, plan: dict[int, str]) -> None:
        super().__init__()
        self.plan = plan
        self.asked_for: set[str] = set()

    @activity.defn(name="pending_items")
    async def pending_items(self, inp: PendingInput) -> list[int] | Page:  # type: ignore[override]
        self.asked_for.add(inp.queue)
        idxs = sorted(i for i in self.pending if i > inp.after_idx)[: inp.limit]
        runs: list[tuple[int, str]] = []
        for i in idxs:
            if runs and runs[-1][1] == self.plan[i]:
                runs[-1] = (runs[-1][0] + 1, self.plan[i])
            else:
                runs.append((1, self.plan[i]))
        return Page(idxs, runs)


async def test_runs_go_to_their_workers_and_a_gone_workers_run_to_the_shared_queue(temporal_address):
    client = await Client.connect(temporal_address)
    tag = uuid.uuid4().hex[:8]
    control, pool = f"control-{tag}", f"engine-{tag}"
    alive, gone = f"{pool}/alive", f"{pool}/gone"
    plan = {i: alive if i < 16 else gone if i < 32 else "" for i in range(ITEMS)}
    journal = Placed(plan)
    inp = BatchInput(f"batch_{tag}", expires_at=4_000_000_000, engine_queue=pool, concurrency=48, group_size=8,
                     sticky_wait_s=1.0)
    async with Worker(client, task_queue=control, workflows=[BatchWorkflow],
                      activities=[journal.validate_batch, journal.pending_items, journal.finalize_batch]), \
            Worker(client, task_queue=pool, activities=[journal.generate]), \
            Worker(client, task_queue=alive, activities=[journal.generate]):  # nothing polls `gone`
        result = await client.execute_workflow(BatchWorkflow.run, inp, id=f"batch-{tag}", task_queue=control)

    assert result == "completed" and journal.asked_for == {pool}
    assert sorted(journal.ran_on) == list(range(ITEMS))  # each once (generate asserts no repeat)
    assert {i for i, q in journal.ran_on.items() if q == alive} == set(range(16))
    assert {i for i, q in journal.ran_on.items() if q == pool} == set(range(16, ITEMS))
    history = await client.get_workflow_handle(f"batch-{tag}").fetch_history()
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes for e in history.events
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "generate"}
    timed_out = [scheduled[e.activity_task_timed_out_event_attributes.scheduled_event_id].task_queue.name
                 for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT]
    assert timed_out == [gone, gone]  # its two groups of 8 waited, then moved
    # Only a worker's own queue has a claim deadline: the shared one waits as long as the window.
    assert {a.task_queue.name: a.schedule_to_start_timeout.ToTimedelta().total_seconds()
            for a in scheduled.values()} == {alive: 1.0, gone: 1.0, pool: 0.0}
    await Replayer(workflows=[BatchWorkflow]).replay_workflow(history)
