"""Batch yielding to interactive surges, again and again, on a stack of its own."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import pytest
from openai import OpenAI

from ballast import pg
from journal.migrate import upgrade
from tests.e2e.conftest import start_stack
from tests.e2e.test_batch import _sql, chat_line, greedy, read_jsonl, submit, wait_for
from tests.e2e.test_interactive import Surges

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quiet(tmp_path_factory, pg_server_url, temporal_address, tiny_model):
    name = f"ballast_test_quiet_{os.getpid()}"
    url = pg.create_database(pg_server_url, name)
    try:
        upgrade(url)
        # 32 slots, so that a burst of 8 chat requests is a surge to the fleet controller
        # (4 or more in flight at once: pressure 0.125 or more) and the other tests' bursts
        # of 2 (0.06) are not; once surging, any chat in a report (0.03) keeps the pool busy.
        s = start_stack(tmp_path_factory.mktemp("quiet"), url, temporal_address, tiny_model, f"quiet-{os.getpid()}",
                        BALLAST_MAX_NUM_SEQS="32", BALLAST_SURGE_HIGH="0.1", BALLAST_SURGE_LOW="0.03",
                        BALLAST_SURGE_COOL_DOWN_S="2", BALLAST_FLEET_TICK_S="0.5", BALLAST_ANNOUNCE_S="0.5",
                        BALLAST_BATCH_ITEMS_PER_RUN="64")
        try:
            yield s, url
        finally:
            s.stop()
    finally:
        pg.drop_database(pg_server_url, name)


CHAT = dict(model="ballast-tiny", messages=[{"role": "user", "content": "surge"}], max_tokens=4, temperature=0)


def burst(url: str, n: int = 2) -> list[int]:
    """A burst of chat: on arrival each request preempts every batch generation on the engine."""
    with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(n) as pool:
        return [r.status_code for r in pool.map(lambda _: http.post("/v1/chat/completions", json=CHAT), range(n))]


async def long_batch(stack, tag: str, prompts: list[str]):
    """A batch of 1000-token greedy generations, one per prompt: (client, batch)."""
    client = OpenAI(base_url=stack.url + "/v1", api_key="test-key", max_retries=0)
    lines = [chat_line(f"{tag}-{i}", p, 1000, ignore_eos=True) for i, p in enumerate(prompts)]
    return client, await asyncio.to_thread(submit, client, lines)


async def engine_batch(db_url: str, until, what: str) -> None:
    """Poll the engine's live /stats (not its once-a-second report) until `until(batch
    generations holding slots)`."""
    [(engine_url,)] = _sql(db_url, "SELECT url FROM engines")
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=10) as http:
        while not until((stats := (await http.get(engine_url + "/stats")).json())["batch"]):
            assert time.monotonic() < deadline, f"{what}: {stats}"
            await asyncio.sleep(0.02)


async def all_generating(db_url: str, batch_id: str, n: int) -> None:
    """Until every unfinished item of the batch holds a slot on the engine."""
    done = "SELECT count(*) FROM events WHERE type = 'item_completed' AND stream LIKE %s"
    with polling(db_url) as conn:  # one connection: a new one per poll forks a backend
        await engine_batch(db_url, lambda held: held >= n - conn.execute(done, (f"item:{batch_id}:%",)).fetchone()[0],
                           "batch never came back")


def polling(db_url: str):
    import psycopg

    from journal.db import libpq_url

    return psycopg.connect(libpq_url(db_url), autocommit=True)


def assert_nothing_lost_and_never_two_at_once(db_url: str, batch_id: str) -> None:
    like = f"item:{batch_id}:%"
    # Nothing lost: at each preemption the chunks journaled so far cover every produced token.
    for stream, offset in _sql(db_url, "SELECT stream, (payload->>'offset')::int FROM events "
                                       "WHERE type = 'item_preempted' AND stream LIKE %(s)s", s=like):
        covered = _sql(db_url, """SELECT coalesce(sum(jsonb_array_length(payload->'token_ids')), 0) FROM events
                                  WHERE stream = %(s)s AND type = 'item_chunk' AND (payload->>'offset')::int < %(o)s""",
                       s=stream, o=offset)[0][0]
        assert covered == offset, (stream, offset, covered)
    # Contiguous, and written by one runner after another: two at once would interleave.
    chunks: dict[str, list[tuple[int, int, str]]] = {}
    for stream, offset, n, runner in _sql(db_url, """SELECT stream, (payload->>'offset')::int,
            jsonb_array_length(payload->'token_ids'), payload->>'runner' FROM events
            WHERE type = 'item_chunk' AND stream LIKE %(s)s ORDER BY position""", s=like):
        chunks.setdefault(stream, []).append((offset, n, runner))
    for stream, cs in chunks.items():
        assert [o for o, _, _ in cs] == [sum(n for _, n, _ in cs[:i]) for i in range(len(cs))], stream
        runs = [r for i, (_, _, r) in enumerate(cs) if i == 0 or cs[i - 1][2] != r]
        assert len(runs) == len(set(runs)), (stream, runs)
    assert _sql(db_url, """SELECT stream FROM events WHERE stream LIKE %(s)s AND type IN ('item_completed', 'item_failed')
                           GROUP BY stream HAVING count(*) > 1""", s=like) == []


@pytest.mark.parametrize("k", [1, 2, 3])
async def test_items_preempted_k_times_at_random_offsets_finish_exactly(quiet, engine, k):
    """k bursts, each once every item is generating again and has run for a random while:
    every item is preempted exactly k times, at offsets of its own, and still finishes
    token-for-token as its uninterrupted greedy run; nothing produced was lost."""
    stack, db_url = quiet
    # 32 at once (every slot) share the engine's steps: each makes ~200 tokens/s, not ~1500
    # as 6 would, so that k rounds of yield-and-resume fit well within 1000.
    prompts = [f"preempt me {k}.{i}" for i in range(32)]
    client, batch = await long_batch(stack, "p", prompts)
    rng = random.Random(k)
    for _ in range(k):
        await all_generating(db_url, batch.id, 32)
        await asyncio.sleep(rng.uniform(0.02, 0.2))
        assert await asyncio.to_thread(burst, stack.url) == [200, 200]
        await engine_batch(db_url, lambda held: held == 0, "batch did not yield")  # every generation yielded
    b = await asyncio.to_thread(wait_for, client, batch.id)
    assert b.status == "completed", b
    offsets = _sql(db_url, """SELECT stream, array_agg((payload->>'offset')::int ORDER BY position) FROM events
                              WHERE type = 'item_preempted' AND stream LIKE %(s)s GROUP BY stream""", s=f"item:{batch.id}:%")
    assert b.model_extra["ballast"] == {"preemptions": 32 * k, "items_preempted": 32}, offsets
    assert len(offsets) == 32 and all(len(o) == k and o == sorted(o) for _, o in offsets), offsets
    assert len({tuple(o) for _, o in offsets}) > 1  # offsets of their own, not one schedule for all

    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    expected = await asyncio.gather(*(greedy(engine, p, 1000, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
    assert_nothing_lost_and_never_two_at_once(db_url, batch.id)


async def test_the_fleet_controller_holds_batch_out_of_a_surging_pool_until_it_calms(quiet, engine):
    """Bursts of 8 chat requests (pressure ≥ 0.1) with calm spells of ~1 s between
    them: longer than the engine's own cool-down (0.5 s), which alone would let batch back
    in each time, shorter than the pool's (2 s). The controller keeps batch out throughout."""
    stack, db_url = quiet
    prompts = [f"fleet {i}: {'x' * (i % 5)}" for i in range(24)]
    client, batch = await long_batch(stack, "f", prompts)
    like = f"item:{batch.id}:%"
    chunks = "SELECT count(*) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
    deadline = time.monotonic() + 60
    while _sql(db_url, chunks, s=like)[0][0] == 0:  # generating
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    surge = "SELECT type, payload, committed_at FROM events WHERE stream = 'fleet:ballast-tiny' ORDER BY position"
    with Surges(stack.url, gaps=(0.8, 1.2), burst=8, max_tokens=64) as surges:
        deadline = time.monotonic() + 60
        while not _sql(db_url, surge):
            assert time.monotonic() < deadline, "no surge"
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)
    assert set(surges.statuses) == {200}
    b = await asyncio.to_thread(wait_for, client, batch.id)  # only once the pool has calmed
    assert b.status == "completed" and b.model_extra["ballast"]["preemptions"] >= 1
    [(t0, started, began), (t1, ended, finished)] = _sql(db_url, surge)[:2]
    [(engine_id,)] = _sql(db_url, "SELECT id FROM engines")
    assert (t0, t1) == ("surge_started", "surge_ended")
    assert started["engines"] == [engine_id] and started["batch_cap"] == {engine_id: 0} and started["pressure"] >= 0.1
    assert ended["duration_s"] > 5  # held through every calm spell while the bursts went on

    # From a second after the cap went out (preempted generations flush, the engine reads
    # its cap within 0.5 s) until the surge ended, batch produced nothing: held out.
    during = _sql(db_url, chunks + " AND committed_at > %(a)s::timestamptz + interval '1 second' AND committed_at < %(b)s",
                  s=like, a=began, b=finished)[0][0]
    after = _sql(db_url, chunks + " AND committed_at > %(b)s", s=like, b=finished)[0][0]
    assert during == 0 and after > 0, (during, after)
    assert _sql(db_url, "SELECT batch_cap FROM engines")[0][0] is None  # lifted
    assert ("fleet", "engine_joined", {"engine": engine_id}) in _sql(
        db_url, "SELECT stream, type, payload FROM events WHERE stream = 'fleet'")

    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    expected = await asyncio.gather(*(greedy(engine, p, 1000, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected


async def test_engine_worker_sigkilled_during_a_preemption(quiet, engine):
    """The worker dies while its generations are yielding (some have journaled their
    preemption, others are still flushing). Destructive: the stack's engine worker is
    replaced, so this runs last in the module. A fresh worker finishes every item exactly
    once, never two runners on one item, and the outputs are still greedy-exact."""
    stack, db_url = quiet
    prompts = [f"kill me {i}" for i in range(16)]
    client, batch = await long_batch(stack, "x", prompts)
    like = f"item:{batch.id}:%"
    preempted = "SELECT count(*) FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s"
    await all_generating(db_url, batch.id, 16)
    victim = stack.engine
    chat = asyncio.create_task(asyncio.to_thread(burst, stack.url))
    try:
        deadline = time.monotonic() + 30
        with polling(db_url) as conn:  # polled every few ms: one connection, not a backend fork each time
            while conn.execute(preempted, dict(s=like)).fetchone()[0] == 0:
                assert time.monotonic() < deadline, f"no preemption; chat: {chat}"
                await asyncio.sleep(0.005)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        at_kill = _sql(db_url, preempted, s=like)[0][0]
    finally:
        stack.start_engine()
    await chat  # whatever the chat got from a dying engine; it is not what is under test
    await asyncio.to_thread(stack.wait_healthy)
    b = await asyncio.to_thread(wait_for, client, batch.id)
    assert b.status == "completed" and b.request_counts.completed == 16, b
    assert 1 <= at_kill <= 16
    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    assert [o["custom_id"] for o in out] == [f"x-{i}" for i in range(16)]
    expected = await asyncio.gather(*(greedy(engine, p, 1000, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
    assert_nothing_lost_and_never_two_at_once(db_url, batch.id)
