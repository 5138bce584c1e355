"""A worker dies mid-batch. Destructive (the stack's engine worker is replaced), so it runs
after the other end-to-end tests, which share that stack."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ballast import procs
from tests.e2e.test_batch import TOPICS, _sql, chat_line, greedy, read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e


async def test_engine_worker_sigkilled_mid_batch_resumes_without_duplicates(client, stack, engine, db_url):
    prompts = [f"crash test {i}: {TOPICS[i % len(TOPICS)]}" for i in range(24)]
    lines = [chat_line(f"k-{i}", p, 900, ignore_eos=True) for i, p in enumerate(prompts)]
    batch = await asyncio.to_thread(submit, client, lines)
    chunks = "SELECT count(*) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
    completed = "SELECT count(*) FROM events WHERE type = 'item_completed' AND stream LIKE %(s)s"
    like = f"item:{batch.id}:%"
    # Let generations get going and checkpoint, then kill the worker and vLLM outright.
    deadline = time.monotonic() + 120
    while _sql(db_url, chunks, s=like)[0][0] < 16:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    victim = stack.engine
    try:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        # vLLM's processes die with it (a moment later: they run niced, on a busy machine).
        procs.wait_until(lambda: not procs.group_members(victim.pid), 10, "the worker's vLLM processes to die")
        assert _sql(db_url, completed, s=like)[0][0] < 24  # the kill landed mid-batch
        before_restart = _sql(db_url, chunks, s=like)[0][0]
    finally:
        stack.start_engine()  # later tests need an engine, whatever happened here
    await asyncio.to_thread(stack.wait_healthy)
    done = await asyncio.to_thread(wait_for, client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 24
    out = await asyncio.to_thread(read_jsonl, client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"k-{i}" for i in range(24)]  # each once, in order

    dupes = _sql(db_url, """SELECT stream, payload->>'offset', count(*) FROM events
                            WHERE type = 'item_chunk' AND stream LIKE %(s)s GROUP BY 1, 2 HAVING count(*) > 1""", s=like)
    assert dupes == []
    assert _sql(db_url, chunks, s=like)[0][0] > before_restart  # the new worker carried on
    # Resumed from the journal on a fresh engine, each text is still vLLM's greedy output.
    expected = await asyncio.gather(*(greedy(engine, p, 900, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
