"""A worker dies mid-batch. Destructive (the stack's engine worker is replaced), so it runs
after the other end-to-end tests, which share that stack. "Mid-batch" is a fact, not a
hope: every item is held mid-generation by the engine gate when the kill comes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from ballast import procs
from journal.batches import item_stream
from tests.e2e.conftest import WAIT_S
from tests.e2e.test_batch import TOPICS, _sql, chat_line, greedy, read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e


async def test_engine_worker_sigkilled_mid_batch_resumes_without_duplicates(client, stack, gate, engine, db_url):
    n, length = 24, 300
    prompts = [f"crash test {i:02d}: {TOPICS[i % len(TOPICS)]}" for i in range(n)]  # in byte order, as they run
    lines = [chat_line(f"k-{i}", p, length, ignore_eos=True) for i, p in enumerate(prompts)]
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
    budgets = {item_stream(batch.id, i): rng.randrange(40, 200) for i in range(n)}
    gate.hold(budgets)
    await asyncio.to_thread(stack.wait_held, {it: budgets[it] for it in list(budgets)[:in_flight]})
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

    dupes = _sql(db_url, """SELECT stream, payload->>'offset', count(*) FROM events
                            WHERE type = 'item_chunk' AND stream LIKE %(s)s
                            GROUP BY 1, 2 HAVING count(*) > 1""", s=like)
    assert dupes == []
    assert _sql(db_url, chunks, s=like)[0][0] > before_restart  # the new worker carried on
    # Resumed from the journal on a fresh engine, each text is still vLLM's greedy output.
    expected = await asyncio.gather(*(greedy(engine, p, length, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
