"""The quota reconciler workflow on the real Temporal dev server with its real activity on
the test database: it folds the ledger into quota_usage and expires a dead holder's
reservations every tick, across continue-as-new, and replays deterministically."""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy import text
from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from activities.quota import QuotaActivities
from journal import ledger
from protocol import keys
from protocol.temporal import QuotaInput
from workflows.quota import QuotaReconciler


async def test_the_reconciler_folds_and_expires_across_continue_as_new(temporal_address, db):
    client = await Client.connect(temporal_address)
    queue = f"quota-{uuid.uuid4().hex[:8]}"
    tenant, dead = f"t-{uuid.uuid4().hex[:8]}", f"h-dead-{uuid.uuid4().hex[:8]}"
    subject = keys.request(uuid.uuid4().hex)
    async with db.begin() as c:  # a holder that was never seen: its reservation is an orphan
        await ledger.insert(c, [ledger.Entry(ledger.RESERVE, subject, tenant, "m", "default", 5, 6, dead)])

    async def usage():
        async with db.connect() as c:
            return (await c.execute(text("SELECT requests, in_flight FROM quota_usage WHERE tenant = :t "
                                         "AND \"window\" = 'day'"), dict(t=tenant))).first()

    async with Worker(client, task_queue=queue, workflows=[QuotaReconciler],
                      activities=[QuotaActivities(db).reconcile_quota]):
        handle = await client.start_workflow(QuotaReconciler.run, QuotaInput(1.0, holder_ttl_s=30, ticks_per_run=2),
                                             id=f"quota-{queue}", task_queue=queue)
        for _ in range(200):
            got = await usage()
            if got is not None and tuple(got) == (1, 0):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"never folded and expired: {got}")
        first = client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
        for _ in range(200):  # on through continue-as-new
            if (await first.describe()).status.name == "CONTINUED_AS_NEW":
                break
            await asyncio.sleep(0.05)
        await client.get_workflow_handle(handle.id).terminate()

    async with db.connect() as c:
        kinds = (await c.execute(text("SELECT kind FROM ledger WHERE subject = :s ORDER BY position"),
                                 dict(s=subject))).scalars().all()
    assert kinds == ["reserve", "expire"]
    runs, run_id = 0, handle.first_execution_run_id
    while run_id:
        history = await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        await Replayer(workflows=[QuotaReconciler]).replay_workflow(history)
        runs += 1
        last = history.events[-1]
        run_id = (last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                  if last.HasField("workflow_execution_continued_as_new_event_attributes") else None)
    assert runs >= 2
