"""A worker dies mid-batch. Destructive (the stack's engine worker is replaced), so it runs
after the other end-to-end tests, which share that stack. "Mid-batch" is a fact, not a
hope: every item is held mid-generation by the engine gate when the kill comes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import time

import pytest
import torch
from safetensors.torch import load

from ballast import procs
from protocol import keys
from tests.e2e.conftest import WAIT_S
from tests.e2e.test_batch import TOPICS, _sql, chat_line, greedy, read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e


async def test_engine_worker_sigkilled_mid_batch_resumes_without_duplicates(client, stack, gate, engine, db_url):
    n, length = 24, 300
    prompts = [f"crash test {i:02d}: {TOPICS[i % len(TOPICS)]}" for i in range(n)]  # in byte order, as they run
    lines = [chat_line(f"k-{i}", p, length, ignore_eos=True) for i, p in enumerate(prompts)]
    # Some with two choices, each greedy's text (top_k 1), each journaled and resumed on its own.
    two = {0, 5, 10}
    for i in two:
        lines[i]["body"].update(n=2, temperature=1.0, top_k=1)
    gate.hold(0)
    batch = await asyncio.to_thread(submit, client, lines)
    chunks = "SELECT count(*) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
    completed = "SELECT count(*) FROM events WHERE type = 'item_completed' AND stream LIKE %(s)s"
    like = f"item:{batch.id}:%"
    # Every item in flight mid-generation, at an offset of its own, with a checkpoint or
    # more in the journal: then kill the worker and vLLM outright. (A workflow run has at
    # most BALLAST_BATCH_ITEMS_PER_RUN items in flight; the rest start after continue-as-new.)
    in_flight = min(n, int(stack.env["BALLAST_BATCH_ITEMS_PER_RUN"]))
    rng = random.Random(24)
    budgets = {keys.item(batch.id, i): rng.randrange(40, 200) for i in range(n)}
    budgets |= {f"{keys.item(batch.id, i)}#1": rng.randrange(40, 200) for i in sorted(two)}  # the second choices
    gate.hold(budgets)
    await asyncio.to_thread(stack.wait_held, {it: budgets[it] for it in budgets
                                              if int(it.split(":")[-1].split("#")[0]) < in_flight})
    deadline = time.monotonic() + WAIT_S
    while _sql(db_url, "SELECT count(DISTINCT stream) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s",
               s=like)[0][0] < in_flight:
        assert time.monotonic() < deadline, "not every item checkpointed"
        await asyncio.sleep(0.05)
    victim = stack.engine
    try:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        # vLLM's processes die with it (a moment later: they run niced, on a busy machine).
        procs.wait_until(lambda: not procs.group_members(victim.pid), 10, "the worker's vLLM processes to die")
        assert _sql(db_url, completed, s=like)[0][0] == 0  # the kill landed mid-batch: every item was held
        before_restart = _sql(db_url, chunks, s=like)[0][0]
    finally:
        gate.release()  # the new worker runs every item to its end
        stack.start_engine()  # later tests need an engine, whatever happened here
    await asyncio.to_thread(stack.wait_healthy)
    done = await asyncio.to_thread(wait_for, client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == n
    out = await asyncio.to_thread(read_jsonl, client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"k-{i}" for i in range(n)]  # each once, in order

    dupes = _sql(db_url, """SELECT stream, payload->>'choice', payload->>'offset', count(*) FROM events
                            WHERE type = 'item_chunk' AND stream LIKE %(s)s
                            GROUP BY 1, 2, 3 HAVING count(*) > 1""", s=like)
    assert dupes == []
    assert _sql(db_url, chunks, s=like)[0][0] > before_restart  # the new worker carried on
    # Resumed from the journal on a fresh engine, each text is still vLLM's greedy output.
    expected = await asyncio.gather(*(greedy(engine, p, length, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
    assert [o["response"]["body"]["choices"][1]["message"]["content"] for o in out if len(
        o["response"]["body"]["choices"]) == 2] == [expected[i] for i in sorted(two)]
    # The second choices were mid-output at the kill too: each journaled by the killed
    # worker's attempt, then resumed from there by the new one's.
    assert sorted(_sql(db_url, """SELECT stream, count(DISTINCT payload->>'runner') FROM events
                                  WHERE type = 'item_chunk' AND stream LIKE %(s)s AND payload->>'choice' = '1'
                                  GROUP BY stream""", s=like)) == sorted((keys.item(batch.id, i), 2) for i in two)


async def test_a_fine_tuning_job_preempted_and_sigkilled_mid_chunk_trains_as_one_uninterrupted_run(
        client, stack, tiny_model, db_url, temporal_address):
    """Chats preempt the job at random steps (each chunk stops after its step and
    checkpoints), then its engine worker is SIGKILLed mid-chunk, with steps trained past
    its last checkpoint: those are lost, redone on the new worker from that checkpoint.
    The adapter and the loss curve equal those of one uninterrupted run here, bit for bit."""
    from temporalio.client import Client
    from transformers import AutoTokenizer

    from tests.e2e.test_fine_tuning import wait_final
    from training.trainer import Hyper, Trainer, encode_chat

    chats = [[dict(role="user", content=f"Colour {i}?"),
              dict(role="assistant", content=random.Random(i).choice(["red", "green", "blue"]))] for i in range(40)]
    epochs, seed = 50, 5  # 1,000 steps of 2 examples: seconds of training, long enough to interrupt
    total = epochs * len(chats) // 2
    body = "".join(json.dumps(dict(messages=c)) + "\n" for c in chats).encode()
    file_id = client.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, seed=seed,
                                         hyperparameters=dict(n_epochs=epochs, batch_size=2))
    steps = "SELECT (payload->>'step')::int FROM events WHERE stream = %(s)s AND type = 'ft_checkpoint' ORDER BY 1"
    stream = keys.ftjob(job.id)

    def on_engine() -> bool:
        return f"ft:{job.id}" in stack.stats()["holds"]

    procs.wait_until(on_engine, WAIT_S, "the job's first chunk on the engine worker")
    rng = random.Random(seed)
    for i in range(3):  # chats at random moments: each preempts the chunk running then
        await asyncio.sleep(rng.uniform(0.3, 1.2))
        reply = await asyncio.to_thread(client.chat.completions.create, model="ballast-tiny", max_tokens=4,
                                        messages=[dict(role="user", content=f"surge {i}")])
        assert reply.choices[0].finish_reason in ("stop", "length")
        procs.wait_until(on_engine, WAIT_S, "the job back on the engine worker after the chat")
    preempted_at = [s for (s,) in _sql(db_url, steps, s=stream)]
    assert len(preempted_at) >= 3 and preempted_at[-1] < total, preempted_at
    running = client.fine_tuning.jobs.retrieve(job.id)  # dated by the pace of its checkpointed chunks
    assert running.status == "running" and running.estimated_finish >= running.created_at

    # Stop the worker mid-chunk, with steps heartbeated past the last checkpoint; then kill it.
    temporal = await Client.connect(temporal_address)
    handle = temporal.get_workflow_handle(f"ftjob:{job.id}")

    async def heartbeated() -> int:
        pending = (await handle.describe()).raw_description.pending_activities
        details = [p.heartbeat_details.payloads for p in pending if p.activity_type.name == "train_chunk"]
        return json.loads(details[0][0].data) if details and details[0] else 0

    victim = stack.engine
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, "never caught the chunk with unsaved steps"
        last = max((s for (s,) in _sql(db_url, steps, s=stream)), default=0)
        if await heartbeated() > last and on_engine():
            os.killpg(victim.pid, signal.SIGSTOP)
            saved, beat = max(s for (s,) in _sql(db_url, steps, s=stream)), await heartbeated()
            if beat > saved:
                break
            os.killpg(victim.pid, signal.SIGCONT)
        await asyncio.sleep(0.05)
    try:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        procs.wait_until(lambda: not procs.group_members(victim.pid), 10, "the worker's vLLM processes to die")
    finally:
        stack.start_engine()
    await asyncio.to_thread(stack.wait_healthy)
    done = await asyncio.to_thread(wait_final, client, job.id, 300)
    assert done.status == "succeeded", done.error

    # Each step checkpointed once at most, and the killed chunk was retried (from `saved`,
    # its steps up to `beat` trained again): the curve and weights below prove how.
    after = [s for (s,) in _sql(db_url, steps, s=stream)]
    assert len(after) == len(set(after)) and after[-1] == total and saved < beat
    from temporalio.api.enums.v1 import EventType

    retried = [e.activity_task_started_event_attributes.attempt async for e in handle.fetch_history_events()
               if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED]
    assert max(retried) >= 2, retried
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    whole = Trainer(tiny_model.path, [encode_chat(tok, c) for c in chats],
                    Hyper(n_epochs=epochs, batch_size=2, learning_rate=1e-3, seed=seed), tok.eos_token_id)
    await asyncio.to_thread(whole.run, total)
    curve = [x for (p,) in _sql(db_url, "SELECT payload FROM events WHERE stream = %(s)s AND type = 'ft_checkpoint' "
                                        "ORDER BY (payload->>'step')::int", s=stream) for x in p["losses"]]
    assert curve == whole.losses
    with open(stack.root / "objects" / keys.adapter(job.id) / "adapter_model.safetensors", "rb") as f:
        served = load(f.read())
    mine = whole.weights()
    assert served.keys() == mine.keys() and all(torch.equal(served[k], mine[k]) for k in mine)
