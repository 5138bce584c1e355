"""The fine-tuning workflow on the real Temporal dev server, Postgres and the object
store, with the real activities training the tiny model in-process:

- a job run in one chunk, and the same job in chunks of 2 with a chunk killed mid-way
  (an exception after a step it never checkpointed: Temporal retries it from the last
  checkpoint) and a pause in between, end with bitwise-equal adapters and equal loss
  curves (read back from the journal in SQL);
- while paused no step runs; resume continues from the checkpoint;
- a corrupted latest checkpoint is found by its checksum, the job falls back to the one
  before, says so in its events, rewrites it, and still ends bitwise equal;
- cancel ends the job `cancelled` with its checkpoints kept;
- a job that continues as new every two chunks ends the same.

The history of each replays."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import pytest
import torch
from safetensors.torch import load
from sqlalchemy import text
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Replayer, Worker

from activities.finetune import FineTuneActivities
from journal import batch_store, finetune_store
from journal.events import append_one
from protocol import keys
from protocol.temporal import FineTuneInput
from storage.objects import ObjectStore
from workflows.finetune import FineTuneWorkflow

EXAMPLES = [dict(messages=[dict(role="system", content="You answer in one word."),
                           dict(role="user", content=f"Colour {i}?"),
                           dict(role="assistant", content=random.Random(i).choice(["red", "green", "blue"]))])
            for i in range(10)]
STEPS = 8  # 2 epochs of 10 examples in batches of 3


class Crashing(FineTuneActivities):
    """Fails the chunk once, right after step `at` (before its checkpoint)."""

    def __init__(self, *args, at: int, **kw):
        super().__init__(*args, **kw)
        self.at, self.crashed = at, False

    def stepped(self, trainer) -> None:
        if trainer.step == self.at and not self.crashed:
            self.crashed = True
            raise RuntimeError(f"killed after step {self.at}")


@pytest.fixture
def store(tmp_path):
    return ObjectStore(str(tmp_path / "objects"))


async def make_job(db, store: ObjectStore, tenant: str = "ft") -> str:
    tag = uuid.uuid4().hex[:10]
    file_id, job_id = f"file-{tag}", f"ftjob-{tag}"
    body = "".join(json.dumps(e) + "\n" for e in EXAMPLES).encode()
    with store.writer(f"files/{file_id}") as f:
        f.write(body)
    async with db.begin() as c:
        await batch_store.create_file(c, dict(id=file_id, tenant=tenant, purpose="fine-tune", filename="train.jsonl",
                                              bytes=len(body), object_key=f"files/{file_id}",
                                              created_at=int(time.time())))
        await append_one(c, finetune_store.created_event(dict(
            id=job_id, tenant=tenant, model="ballast-tiny", training_file=file_id, validation_file=None,
            hyperparameters=dict(n_epochs=2, batch_size=3, learning_rate=1e-3), seed=7, suffix="colours",
            metadata=None, status="validating_files", error=None, fine_tuned_model=None, trained_tokens=None,
            result_files=[], created_at=int(time.time()), finished_at=None)))
    return job_id


class Run:
    def __init__(self, client: Client, db, acts: FineTuneActivities, chunk_steps: int, chunks_per_run: int = 100,
                 checkpoint_overhead: float = 0.0, chunk_max_s: float = 300.0):
        tag = uuid.uuid4().hex[:8]
        self.checkpoint_overhead, self.chunk_max_s = checkpoint_overhead, chunk_max_s
        self.client, self.db, self.acts = client, db, acts
        self.control, self.engine, self.chunk_steps = f"control-{tag}", f"engine-{tag}", chunk_steps
        self.chunks_per_run = chunks_per_run

    def workers(self) -> tuple[Worker, Worker]:
        return (Worker(self.client, task_queue=self.control, workflows=[FineTuneWorkflow],
                       activities=[self.acts.validate_training_file, self.acts.fine_tune_status]),
                Worker(self.client, task_queue=self.engine, activities=[self.acts.train_chunk]))

    async def start(self, job_id: str) -> WorkflowHandle:
        return await self.client.start_workflow(
            FineTuneWorkflow.run, FineTuneInput(job_id, self.engine, chunk_steps=self.chunk_steps,
                                                heartbeat_timeout_s=10, chunks_per_run=self.chunks_per_run,
                                                checkpoint_overhead=self.checkpoint_overhead,
                                                chunk_max_s=self.chunk_max_s),
            id=f"ftjob:{job_id}", task_queue=self.control)


async def sql(db, q: str, **params) -> list[tuple]:
    async with db.connect() as c:
        return [tuple(r) for r in (await c.execute(text(q), params)).all()]


async def losses(db, job_id: str) -> list[float]:
    """The loss curve, from the journal: every checkpoint's losses in step order."""
    rows = await sql(db, "SELECT payload FROM events WHERE stream = :s AND type = 'ft_checkpoint' "
                         "ORDER BY (payload->>'step')::int", s=keys.ftjob(job_id))
    return [x for (p,) in rows for x in p["losses"]]


def adapter(store: ObjectStore, job_id: str) -> dict[str, torch.Tensor]:
    with store.open(f"{keys.adapter(job_id)}/adapter_model.safetensors") as f:
        return load(f.read())


async def wait_until(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := await check()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)
    return got


async def status(db, job_id: str) -> str:
    return (await sql(db, "SELECT status FROM fine_tuning_jobs WHERE id = :j", j=job_id))[0][0]


async def steps_done(db, job_id: str) -> int:
    got = await sql(db, "SELECT max((payload->>'step')::int) FROM events WHERE stream = :s AND type = 'ft_checkpoint'",
                    s=keys.ftjob(job_id))
    return got[0][0] or 0


async def test_chunks_killed_and_paused_end_bitwise_equal_to_one_uninterrupted_run(temporal_address, db, store,
                                                                                  tiny_model):
    client = await Client.connect(temporal_address)
    whole_id, chunked_id = await make_job(db, store), await make_job(db, store)

    whole = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), STEPS * 2)
    w1, w2 = whole.workers()
    async with w1, w2:
        assert await (await whole.start(whole_id)).result() == "succeeded"

    # Two chunks a run: the job continues as new on the way, paused or not.
    chunked = Run(client, db, Crashing(db, store, tiny_model.path, tiny_model.max_model_len, at=5), 2,
                  chunks_per_run=2)
    w1, w2 = chunked.workers()
    async with w1, w2:
        handle = await chunked.start(chunked_id)
        await wait_until(lambda: steps_done(db, chunked_id), "a first checkpoint")
        await handle.signal(FineTuneWorkflow.pause)
        await wait_until(lambda: _is(db, chunked_id, "paused"), "paused")
        held = await steps_done(db, chunked_id)
        await asyncio.sleep(1.5)
        assert await steps_done(db, chunked_id) == held < STEPS  # nothing trains while paused
        await handle.signal(FineTuneWorkflow.resume)
        assert await handle.result() == "succeeded"
    assert isinstance(chunked.acts, Crashing) and chunked.acts.crashed

    assert await losses(db, chunked_id) == await losses(db, whole_id) and len(await losses(db, whole_id)) == STEPS
    a, b = adapter(store, whole_id), adapter(store, chunked_id)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(t.abs().sum()) > 0 for k, t in a.items() if "lora_B" in k)  # it trained (B starts at 0)
    # Every step checkpointed once, in chunks of 2 (the killed chunk's retry wrote step 6 once).
    steps = [s for (s,) in await sql(db, "SELECT (payload->>'step')::int FROM events WHERE stream = :s AND "
                                         "type = 'ft_checkpoint' ORDER BY position", s=keys.ftjob(chunked_id))]
    assert steps == [2, 4, 6, 8]
    # Each checkpoint's trained tokens settled in the ledger once, retry or not: as the
    # uninterrupted run's in total.
    settled = "SELECT sum(input_tokens), count(*) FROM ledger WHERE kind = 'settle' AND subject LIKE :s"
    whole_settled = (await sql(db, settled, s=f"ftjob:{whole_id}:%"))[0]
    assert (await sql(db, settled, s=f"ftjob:{chunked_id}:%"))[0] == (whole_settled[0], 4) and whole_settled[1] == 1
    job = (await sql(db, "SELECT status, fine_tuned_model, trained_tokens, result_files FROM fine_tuning_jobs "
                         "WHERE id = :j", j=chunked_id))[0]
    assert job[0] == "succeeded" and job[1] == f"ft:ballast-tiny:colours:{chunked_id}" and job[2] > 0
    with store.open(f"files/{job[3][0]}") as f:
        csv_rows = f.read().decode().splitlines()
    assert csv_rows[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"
    assert len(csv_rows) == STEPS + 1 and all(r.count(",") == 4 and not r.endswith(",,,") for r in csv_rows[1:])
    first_run = client.get_workflow_handle(f"ftjob:{chunked_id}", run_id=handle.first_execution_run_id)
    for h in (first_run, handle, client.get_workflow_handle(f"ftjob:{whole_id}")):
        await Replayer(workflows=[FineTuneWorkflow]).replay_workflow(await h.fetch_history())
    assert (await first_run.describe()).status.name == "CONTINUED_AS_NEW"


async def test_a_chunk_trains_past_its_steps_while_its_overhead_is_above_its_share(temporal_address, db, store,
                                                                                   tiny_model):
    """CheckFreq's rule: chunks of at least 1 step, longer while dispatch, resume and
    checkpoint cost more than `checkpoint_overhead` of the steps' time, but never past
    `chunk_max_s`. Each checkpoint journals where its chunk's time went."""
    client = await Client.connect(temporal_address)

    async def checkpointed(checkpoint_overhead: float, chunk_max_s: float = 300.0) -> list[dict]:
        job_id = await make_job(db, store)
        run = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), 1,
                  checkpoint_overhead=checkpoint_overhead, chunk_max_s=chunk_max_s)
        w1, w2 = run.workers()
        async with w1, w2:
            assert await (await run.start(job_id)).result() == "succeeded"
        return [p for (p,) in await sql(db, "SELECT payload FROM events WHERE stream = :s AND type = 'ft_checkpoint' "
                                            "ORDER BY position", s=keys.ftjob(job_id))]

    exact = await checkpointed(checkpoint_overhead=0)  # off: every chunk its 1 step
    assert [c["step"] for c in exact] == list(range(1, STEPS + 1))
    # No overhead is small enough for a share of 1e-9: the one chunk trains every step.
    assert [c["step"] for c in await checkpointed(checkpoint_overhead=1e-9, chunk_max_s=600)] == [STEPS]
    # … unless the chunk's time is up: then 1 step a chunk again.
    assert [c["step"] for c in await checkpointed(checkpoint_overhead=1e-9, chunk_max_s=1e-6)] == list(
        range(1, STEPS + 1))
    for c in exact:
        t = c["timing"]
        assert set(t) == {"dispatch_s", "between_s", "resume_s", "wait_s", "train_s", "checkpoint_s"}
        assert min(t.values()) >= 0 and t["train_s"] > 0 and c["bytes"] > 0
    assert [c["ended_by"] for c in exact] == ["steps"] * (STEPS - 1) + ["done"]


async def test_a_corrupted_checkpoint_falls_back_to_the_one_before(temporal_address, db, store, tiny_model):
    client = await Client.connect(temporal_address)
    whole_id, job_id = await make_job(db, store), await make_job(db, store)
    whole = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), STEPS)
    run = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), 2)
    for r in (whole, run):
        w1, w2 = r.workers()
        async with w1, w2:
            if r is whole:
                assert await (await r.start(whole_id)).result() == "succeeded"
                continue
            handle = await r.start(job_id)
            await wait_until(lambda: _at_least(db, job_id, 4), "two checkpoints")
            await handle.signal(FineTuneWorkflow.pause)
            await wait_until(lambda: _is(db, job_id, "paused"), "paused")
            newest = await steps_done(db, job_id)
            key = keys.checkpoint(job_id, newest)
            with store.open(key) as f:
                data = bytearray(f.read())
            data[len(data) // 2] ^= 0xFF
            with store.writer(key) as f:
                f.write(bytes(data))
            await handle.signal(FineTuneWorkflow.resume)
            assert await handle.result() == "succeeded"
    events = [p["message"] for (p,) in await sql(db, "SELECT payload FROM events WHERE stream = :s AND "
                                                     "type = 'ft_event' ORDER BY position", s=keys.ftjob(job_id))]
    assert f"The checkpoint at step {newest} fails its checksum; resuming from an earlier one." in events
    a, b = adapter(store, whole_id), adapter(store, job_id)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert await losses(db, job_id) == await losses(db, whole_id)


async def test_cancel_ends_the_job_with_its_checkpoints_kept(temporal_address, db, store, tiny_model):
    client = await Client.connect(temporal_address)
    job_id = await make_job(db, store)
    run = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), 1)
    w1, w2 = run.workers()
    async with w1, w2:
        handle = await run.start(job_id)
        await wait_until(lambda: _at_least(db, job_id, 2), "two checkpoints")
        await handle.signal(FineTuneWorkflow.cancel)
        assert await handle.result() == "cancelled"
    assert await status(db, job_id) == "cancelled"
    kept = await sql(db, "SELECT payload->>'object_key' FROM events WHERE stream = :s AND type = 'ft_checkpoint'",
                     s=keys.ftjob(job_id))
    assert len(kept) >= 2 and all(store.exists(k) for (k,) in kept)
    assert not store.exists(f"{keys.adapter(job_id)}/adapter_model.safetensors")


async def _is(db, job_id: str, want: str) -> bool:
    return await status(db, job_id) == want


async def _at_least(db, job_id: str, steps: int) -> bool:
    return await steps_done(db, job_id) >= steps


class Surging(FineTuneActivities):
    """After step `at`, a chat arrives at the engine (a real EngineSlots with one slot):
    the chunk's batch slot is preempted, it stops after that step and checkpoints; the
    next chunk waits for a slot until the chat has gone."""

    def __init__(self, *args, at: int, **kw):
        super().__init__(*args, **kw)
        self.at = at
        self.chats: list[asyncio.Task] = []

    def stepped(self, trainer) -> None:
        if trainer.step == self.at and not self.chats:
            async def chat() -> None:
                async with self.slots.interactive_request("api"):
                    await asyncio.sleep(1.0)
            self.chats.append(asyncio.get_running_loop().create_task(chat()))


async def test_a_chunk_preempted_by_a_chat_resumes_after_it_bitwise_equal(temporal_address, db, store, tiny_model):
    from engine.slots import EngineSlots

    client = await Client.connect(temporal_address)
    whole_id, job_id = await make_job(db, store), await make_job(db, store)
    whole = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), STEPS)
    slots = EngineSlots(1, cool_down_s=0.2)
    surged = Run(client, db, Surging(db, store, tiny_model.path, tiny_model.max_model_len, slots=slots, at=3), STEPS)
    for r, j in ((whole, whole_id), (surged, job_id)):
        w1, w2 = r.workers()
        async with w1, w2:
            handle = await r.start(j)
            assert await handle.result() == "succeeded"
    assert slots.stats.preemptions == 1
    steps = [s for (s,) in await sql(db, "SELECT (payload->>'step')::int FROM events WHERE stream = :s AND "
                                         "type = 'ft_checkpoint' ORDER BY position", s=keys.ftjob(job_id))]
    # The chat lands while step 4 runs: the chunk finishes that step, checkpoints, and the
    # next chunk resumes there once the chat has gone.
    assert steps == [4, STEPS]
    a, b = adapter(store, whole_id), adapter(store, job_id)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert await losses(db, job_id) == await losses(db, whole_id)
    await Replayer(workflows=[FineTuneWorkflow]).replay_workflow(await handle.fetch_history())


async def test_training_waits_for_the_next_day_once_the_tenants_daily_tokens_are_spent(temporal_address, db, store,
                                                                                      tiny_model):
    """tokens_per_day counts training: once a chunk's settled tokens reach it, the next chunk
    trains nothing and the job waits for the next UTC day (saying so in its events), still
    running; a cancel ends the wait."""
    from journal import tenant_store

    tenant = "ftday-" + uuid.uuid4().hex[:6]
    async with db.begin() as c:
        await tenant_store.ensure_tenant(c, tenant)
        await tenant_store.set_limits(c, tenant, "*", tokens_per_day=1)
    job_id = await make_job(db, store, tenant)
    client = await Client.connect(temporal_address)
    run = Run(client, db, FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len), 2)
    w1, w2 = run.workers()
    async with w1, w2:
        handle = await run.start(job_id)
        waiting = "SELECT payload->>'message' FROM events WHERE stream = :s AND type = 'ft_event' " \
                  "AND payload->>'message' LIKE 'Waiting for the next UTC day%'"
        said = await wait_until(lambda: sql(db, waiting, s=keys.ftjob(job_id)), "the job says it waits")
        assert "tokens_per_day (1 for every model)" in said[0][0]
        assert await steps_done(db, job_id) == 2  # the first chunk trained; the next one did not
        await asyncio.sleep(1.0)
        assert await steps_done(db, job_id) == 2 and await status(db, job_id) == "running"
        settled = await sql(db, "SELECT sum(input_tokens) FROM ledger WHERE kind = 'settle' AND tenant = :t", t=tenant)
        assert settled[0][0] >= 1  # the limit was reached by training's own settled tokens
        await handle.signal(FineTuneWorkflow.cancel)
        assert await handle.result() == "cancelled"


async def test_a_job_over_the_workers_token_cap_fails_naming_it(temporal_address, db, store, tiny_model):
    """The examples live in the engine worker's memory: a file past BALLAST_MAX_TRAINING_TOKENS
    fails the job at once, at the line where it passed the cap, before anything trains."""
    job_id = await make_job(db, store)
    client = await Client.connect(temporal_address)
    acts = FineTuneActivities(db, store, tiny_model.path, tiny_model.max_model_len, max_tokens=100)
    run = Run(client, db, acts, 2)
    w1, w2 = run.workers()
    async with w1, w2:
        assert await (await run.start(job_id)).result() == "failed"
    [(error,)] = await sql(db, "SELECT error FROM fine_tuning_jobs WHERE id = :j", j=job_id)
    assert "more than 100 tokens" in error["message"] and "BALLAST_MAX_TRAINING_TOKENS" in error["message"], error
    assert await steps_done(db, job_id) == 0
