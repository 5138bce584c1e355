"""Batch yielding to interactive surges, again and again, on a stack of its own."""

from __future__ import annotations

import asyncio
import os
import time

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
        # (4 or more in flight at once: pressure 0.125 or more) and the other test's bursts
        # of 2 (0.06) are not.
        s = start_stack(tmp_path_factory.mktemp("quiet"), url, temporal_address, tiny_model, f"quiet-{os.getpid()}",
                        BALLAST_MAX_NUM_SEQS="32", BALLAST_SURGE_HIGH="0.1", BALLAST_SURGE_LOW="0.05",
                        BALLAST_SURGE_COOL_DOWN_S="2", BALLAST_FLEET_TICK_S="0.5", BALLAST_ANNOUNCE_S="0.5")
        try:
            yield s, url
        finally:
            s.stop()
    finally:
        pg.drop_database(pg_server_url, name)


async def test_interactive_surges_preempt_batch_which_resumes_exactly(quiet, engine):
    stack, db_url = quiet
    client = OpenAI(base_url=stack.url + "/v1", api_key="test-key", max_retries=0)
    """Items preempted again and again, at random offsets, finish token-for-token as their
    uninterrupted greedy run; every token produced before a preemption was journaled.
    Run alone, items yield three times or more; inside the full suite (a busier machine)
    they often finish after one or two preemptions, so "every item at least once" is what is
    asserted — an open question noted on the surge issue."""
    prompts = [f"preempt me {i}" for i in range(6)]
    lines = [chat_line(f"p-{i}", p, 1000, ignore_eos=True) for i, p in enumerate(prompts)]
    preempted = "SELECT count(DISTINCT stream) FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s"
    # Every calm spell is a little longer than the stack's 0.5 s cool-down: batch gets back
    # in for a moment, and the next burst preempts it again, until every item has yielded.
    with Surges(stack.url, gaps=(0.7, 1.1)) as surges:
        batch = await asyncio.to_thread(submit, client, lines)
        deadline = time.monotonic() + 180
        while _sql(db_url, preempted, s=f"item:{batch.id}:%")[0][0] < 6:
            assert time.monotonic() < deadline, "not every item was preempted"
            await asyncio.sleep(0.2)
    b = await asyncio.to_thread(wait_for, client, batch.id)
    assert surges.statuses and set(surges.statuses) == {200}
    assert b.status == "completed", b
    assert b.model_extra["ballast"]["preemptions"] >= 6

    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    expected = await asyncio.gather(*(greedy(engine, p, 1000, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected

    like = f"item:{batch.id}:%"
    counts = dict(_sql(db_url, "SELECT stream, count(*) FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s"
                               " GROUP BY stream", s=like))
    assert len(counts) == 6  # each yielded at least once (often 2-3 times: see the docstring)
    # Nothing lost: at each preemption the chunks journaled so far cover every produced token.
    for stream, offset in _sql(db_url, "SELECT stream, (payload->>'offset')::int FROM events "
                                       "WHERE type = 'item_preempted' AND stream LIKE %(s)s", s=like):
        covered = _sql(db_url, """SELECT coalesce(sum(jsonb_array_length(payload->'token_ids')), 0) FROM events
                                  WHERE stream = %(s)s AND type = 'item_chunk' AND (payload->>'offset')::int < %(o)s""",
                       s=stream, o=offset)[0][0]
        assert covered == offset, (stream, offset, covered)


async def test_the_fleet_controller_holds_batch_out_of_a_surging_pool_until_it_calms(quiet, engine):
    """Bursts of 8 chat requests (pressure ≥ 0.1) with calm spells of ~1 s between
    them: longer than the engine's own cool-down (0.5 s), which alone would let batch back
    in each time, shorter than the pool's (2 s). The controller keeps batch out throughout."""
    stack, db_url = quiet
    client = OpenAI(base_url=stack.url + "/v1", api_key="test-key", max_retries=0)
    prompts = [f"fleet {i}: {'x' * (i % 5)}" for i in range(24)]
    batch = await asyncio.to_thread(submit, client, [chat_line(f"f-{i}", p, 1000, ignore_eos=True)
                                                     for i, p in enumerate(prompts)])
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
    deadline = time.monotonic() + 30
    while len(_sql(db_url, surge)) < 2:
        assert time.monotonic() < deadline, "the surge never ended"
        await asyncio.sleep(0.2)
    [(t0, started, began), (t1, ended, finished)] = _sql(db_url, surge)[:2]
    [(engine_id,)] = _sql(db_url, "SELECT id FROM engines")
    assert (t0, t1) == ("surge_started", "surge_ended")
    assert started["engines"] == [engine_id] and started["batch_cap"] == {engine_id: 0} and started["pressure"] >= 0.1
    assert ended["duration_s"] > 5

    b = await asyncio.to_thread(wait_for, client, batch.id)
    assert b.status == "completed" and b.model_extra["ballast"]["preemptions"] >= 1
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
