"""Batch yielding to interactive surges, again and again, on a stack of its own.

Where preemptions land is decided by the tests, not by how fast the engine runs: batch
generations are held at token budgets by the engine gate (engine/gate.py), and every wait
is on a state the engine or the journal reports."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protocol import keys
from tests.e2e import test_oracle as oracle
from tests.e2e.conftest import WAIT_S, own_stack
from tests.e2e.test_batch import _sql, chat_line, greedy, read_jsonl, submit, wait_for
from tests.e2e.test_interactive import Surges

pytestmark = pytest.mark.e2e

vllm_run = oracle.vllm_run  # vLLM's own answers to the oracle's lines (a session fixture)
LENGTH = 160  # tokens per item: the gate, not the length, keeps items in flight


@pytest.fixture(scope="module")
def quiet(tmp_path_factory, pg_server_url, temporal_address, tiny_model):
    # 32 slots, so that a burst of 8 chat requests is a surge to the fleet controller
    # (4 or more in flight at once: pressure 0.125 or more) and the other tests' bursts
    # of 2 (0.06) are not; once surging, any chat in a report (0.03) keeps the pool busy.
    with own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "quiet",
                   BALLAST_MAX_NUM_SEQS="32", BALLAST_SURGE_HIGH="0.1", BALLAST_SURGE_LOW="0.03",
                   BALLAST_SURGE_COOL_DOWN_S="2", BALLAST_FLEET_TICK_S="0.5", BALLAST_ANNOUNCE_S="0.5",
                   BALLAST_BATCH_ITEMS_PER_RUN="64") as stack_and_url:
        yield stack_and_url


CHAT = dict(model="ballast-tiny", messages=[{"role": "user", "content": "surge"}], max_tokens=4, temperature=0)


def burst(stack, n: int = 2) -> list[int]:
    """A burst of chat: on arrival each request preempts every batch generation on the engine."""
    with stack.http(timeout=60) as http, ThreadPoolExecutor(n) as pool:
        return [r.status_code for r in pool.map(lambda _: http.post("/v1/chat/completions", json=CHAT), range(n))]


async def long_batch(stack, tag: str, prompts: list[str], max_tokens: int = LENGTH):
    """A batch of greedy generations of `max_tokens` each, one per prompt: (client, batch).
    Not long to keep them in flight (the gate does that), long enough to hold anywhere."""
    client = stack.openai()
    lines = [chat_line(f"{tag}-{i}", p, max_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
    return client, await asyncio.to_thread(submit, client, lines)


async def preempt_at(stack, db_url: str, batch_id: str, budgets: dict[str, int], total: int) -> None:
    """Every item named generating (a batch slot held), exactly at its budget at the gate:
    then a burst of chat, and wait until the journal holds `total` preemptions."""
    stack.gate.hold(budgets)
    await asyncio.to_thread(stack.wait_held, budgets)
    assert await asyncio.to_thread(burst, stack) == [200, 200]
    await journaled(db_url, "SELECT count(*) FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s",
                    lambda got: got >= total, "not every item yielded", s=f"item:{batch_id}:%")


async def journaled(db_url: str, sql: str, until, what: str, **params) -> int:
    """Poll the journal (one connection: a new one per poll forks a backend) until
    `until(count)`, where `sql` counts something; the count that satisfied it."""
    deadline = time.monotonic() + WAIT_S
    with polling(db_url) as conn:
        while not until(n := conn.execute(sql, params).fetchone()[0]):
            assert time.monotonic() < deadline, f"{what}: {n}"
            await asyncio.sleep(0.01)
    return n


def preempted_offsets(db_url: str, batch_id: str) -> dict[str, list[int]]:
    """Each preempted item's journaled preemption offsets, in order."""
    return dict(_sql(db_url, """SELECT stream, array_agg((payload->>'offset')::int ORDER BY position) FROM events
                                WHERE type = 'item_preempted' AND stream LIKE %(s)s GROUP BY stream""",
                     s=f"item:{batch_id}:%"))


def polling(db_url: str):
    import psycopg

    from config.database import libpq_url

    return psycopg.connect(libpq_url(db_url), autocommit=True)


def assert_nothing_lost_and_never_two_at_once(db_url: str, batch_id: str) -> None:
    like = f"item:{batch_id}:%"
    # Nothing lost: at each preemption the chunks journaled so far cover every produced
    # token (of the choice that yielded: each of an item's choices has its own offsets).
    for stream, choice, offset in _sql(db_url, """SELECT stream, coalesce(payload->>'choice', '0'),
            (payload->>'offset')::int FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s""", s=like):
        covered = _sql(db_url, """SELECT coalesce(sum(jsonb_array_length(payload->'token_ids')), 0) FROM events
                                  WHERE stream = %(s)s AND type = 'item_chunk' AND (payload->>'offset')::int < %(o)s
                                    AND coalesce(payload->>'choice', '0') = %(c)s""",
                       s=stream, o=offset, c=choice)[0][0]
        assert covered == offset, (stream, choice, offset, covered)
    # Contiguous, and written by one runner after another: two at once would interleave.
    chunks: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for stream, choice, offset, n, runner in _sql(db_url, """SELECT stream, coalesce(payload->>'choice', '0'),
            (payload->>'offset')::int, jsonb_array_length(payload->'token_ids'), payload->>'runner' FROM events
            WHERE type = 'item_chunk' AND stream LIKE %(s)s ORDER BY position""", s=like):
        chunks.setdefault((stream, choice), []).append((offset, n, runner))
    for stream, cs in chunks.items():
        assert [o for o, _, _ in cs] == [sum(n for _, n, _ in cs[:i]) for i in range(len(cs))], stream
        runs = [r for i, (_, _, r) in enumerate(cs) if i == 0 or cs[i - 1][2] != r]
        assert len(runs) == len(set(runs)), (stream, runs)
    assert _sql(db_url, """SELECT stream FROM events
                           WHERE stream LIKE %(s)s AND type IN ('item_completed', 'item_failed')
                           GROUP BY stream HAVING count(*) > 1""", s=like) == []
    # The quota books: a preempted, resumed item settles once, for every token its chunks
    # journaled (SQL over the journal, not the code that settles).
    settled = _sql(db_url, """SELECT l.subject, l.output_tokens,
            (SELECT coalesce(sum(jsonb_array_length(c.payload->'token_ids')), 0) FROM events c
              WHERE c.stream = l.subject AND c.type = 'item_chunk')
            FROM ledger l WHERE l.kind = 'settle' AND l.subject LIKE %(s)s""", s=like)
    results = _sql(db_url, """SELECT count(*) FROM events
                              WHERE stream LIKE %(s)s AND type IN ('item_completed', 'item_failed')""", s=like)[0][0]
    assert len(settled) == results > 0
    assert all(out == chunked for _, out, chunked in settled), settled


@pytest.mark.parametrize("k", [1, 2, 3])
async def test_items_preempted_k_times_at_random_offsets_finish_exactly(quiet, engine, k):
    """k bursts of chat, each once every item holds exactly the next of its own random,
    increasing offsets at the gate: every item is preempted exactly k times, exactly at
    those offsets, and still finishes token-for-token as its uninterrupted greedy run;
    nothing produced was lost, and no item ever had two runners."""
    stack, db_url = quiet
    n = 32  # every slot: one burst preempts all of them at once
    prompts = [f"preempt me {k}.{i}" for i in range(n)]
    rng = random.Random(k)
    try:
        stack.gate.hold(0)  # nothing of the batch gets ahead of the offsets chosen for it
        client, batch = await long_batch(stack, "p", prompts)
        items = [keys.item(batch.id, i) for i in range(n)]
        chosen = {it: sorted(rng.sample(range(1, LENGTH), k)) for it in items}
        for r in range(k):
            await preempt_at(stack, db_url, batch.id, {it: offsets[r] for it, offsets in chosen.items()}, n * (r + 1))
        stack.gate.release()
        b = await asyncio.to_thread(wait_for, client, batch.id)
    finally:
        stack.gate.release()
    assert b.status == "completed", b
    offsets = preempted_offsets(db_url, batch.id)
    assert offsets == chosen  # preempted exactly k times each, exactly where the test chose
    assert _yielded(b) == {"preemptions": n * k, "items_preempted": n, "workflow_url": None}, offsets
    assert len({tuple(o) for o in offsets.values()}) > 1  # offsets of their own, not one schedule for all

    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    expected = await asyncio.gather(*(greedy(engine, p, LENGTH, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
    assert_nothing_lost_and_never_two_at_once(db_url, batch.id)


async def test_the_fleet_controller_holds_batch_out_of_a_surging_pool_until_it_calms(quiet, engine):
    """Bursts of 8 chat requests (pressure ≥ 0.1) with calm spells of ~1 s between
    them: longer than the engine's own cool-down (0.5 s), which alone would let batch back
    in each time, shorter than the pool's (2 s). The batch is held in flight at the gate
    until the surge has capped the engine, then released: from then on only the controller
    keeps it out, and it does, throughout."""
    stack, db_url = quiet
    n, held_at = 24, 60
    prompts = [f"fleet {i}: {'x' * (i % 5)}" for i in range(n)]
    chunks = "SELECT count(*) FROM events WHERE type = 'item_chunk' AND stream LIKE %(s)s"
    surge = "SELECT type, payload, committed_at FROM events WHERE stream = 'fleet:ballast-tiny' ORDER BY position"
    try:
        stack.gate.hold(held_at)
        client, batch = await long_batch(stack, "f", prompts)
        like = f"item:{batch.id}:%"
        await asyncio.to_thread(stack.wait_held, {keys.item(batch.id, i): held_at for i in range(n)})
        with Surges(stack, gaps=(0.8, 1.2), burst=8, max_tokens=64) as surges:
            await journaled(db_url, "SELECT count(*) FROM events WHERE stream = 'fleet:ballast-tiny'",
                            lambda got: got > 0, "no surge")
            # The controller's cap has reached the engine and every batch generation there
            # has yielded (flushed, slot freed): now let the batch go, as far as the gate goes.
            await asyncio.to_thread(stack.wait_stats, lambda s: s["fleet_cap"] == 0 and s["batch"] == 0,
                                    "the fleet's cap did not empty the engine")
            [(released_at,)] = _sql(db_url, "SELECT now()")
            stack.gate.release()
            await asyncio.sleep(5)  # several calm spells, each long enough for the engine's own cool-down
        assert set(surges.statuses) == {200}
        b = await asyncio.to_thread(wait_for, client, batch.id)  # only once the pool has calmed
    finally:
        stack.gate.release()
    assert b.status == "completed", b
    assert _yielded(b) == {"preemptions": n, "items_preempted": n, "workflow_url": None}, b
    assert set(map(tuple, preempted_offsets(db_url, batch.id).values())) == {(held_at,)}
    [(t0, started, began), (t1, ended, finished)] = _sql(db_url, surge)[:2]
    [(engine_id,)] = _sql(db_url, "SELECT id FROM engines")
    assert (t0, t1) == ("surge_started", "surge_ended")
    assert started["engines"] == [engine_id] and started["batch_cap"] == {engine_id: 0} and started["pressure"] >= 0.1
    assert ended["duration_s"] > 5  # held through every calm spell while the bursts went on

    # Released while the pool surged, the batch produced nothing until the surge ended: held
    # out by the controller alone. Then it ran to the end.
    during = _sql(db_url, chunks + " AND committed_at > %(a)s AND committed_at < %(b)s",
                  s=like, a=released_at, b=finished)[0][0]
    after = _sql(db_url, chunks + " AND committed_at > %(b)s", s=like, b=finished)[0][0]
    assert during == 0 and after > 0, (during, after)
    assert _sql(db_url, "SELECT batch_cap FROM engines")[0][0] is None  # lifted
    assert ("fleet", "engine_joined", {"engine": engine_id}) in _sql(
        db_url, "SELECT stream, type, payload FROM events WHERE stream = 'fleet'")

    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    expected = await asyncio.gather(*(greedy(engine, p, LENGTH, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected


async def test_engine_worker_sigkilled_during_a_preemption(quiet, engine):
    """The worker dies while its generations are yielding (once the first has journaled its
    preemption; others may still be flushing). Every item is held at an offset of its own
    when the chat comes, so each is provably mid-generation. Destructive: the stack's
    engine worker is replaced, so this runs last in the module. A fresh worker finishes
    every item exactly once, never two runners on one item, and the outputs are still
    greedy-exact."""
    stack, db_url = quiet
    n = 16
    prompts = [f"kill me {i}" for i in range(n)]
    rng = random.Random(16)
    preempted = "SELECT count(*) FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s"
    try:
        stack.gate.hold(0)
        client, batch = await long_batch(stack, "x", prompts)
        budgets = {keys.item(batch.id, i): rng.randrange(1, LENGTH) for i in range(n)}
        stack.gate.hold(budgets)
        await asyncio.to_thread(stack.wait_held, budgets)
        victim = stack.engine
        chat = asyncio.create_task(asyncio.to_thread(burst, stack))
        await journaled(db_url, preempted, lambda got: got > 0, f"no preemption; chat: {chat}", s=f"item:{batch.id}:%")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        at_kill = _sql(db_url, preempted, s=f"item:{batch.id}:%")[0][0]
    finally:
        stack.gate.release()
        stack.start_engine()  # whatever happened here
    await chat  # whatever the chat got from a dying engine; it is not what is under test
    await asyncio.to_thread(stack.wait_healthy)
    b = await asyncio.to_thread(wait_for, client, batch.id)
    assert b.status == "completed" and b.request_counts.completed == n, b
    assert 1 <= at_kill <= n
    # Each item preempted before the kill was preempted exactly where it was held.
    offsets = preempted_offsets(db_url, batch.id)
    assert offsets and all(o[0] == budgets[it] for it, o in offsets.items()), (offsets, budgets)
    out = await asyncio.to_thread(read_jsonl, client, b.output_file_id)
    assert [o["custom_id"] for o in out] == [f"x-{i}" for i in range(n)]
    expected = await asyncio.gather(*(greedy(engine, p, LENGTH, ignore_eos=True) for p in prompts))
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == expected
    assert_nothing_lost_and_never_two_at_once(db_url, batch.id)


def _yielded(batch) -> dict:
    """The batch object's own account of how it yielded (beside its tokens and pace)."""
    return {k: batch.model_extra["ballast"][k] for k in ("preemptions", "items_preempted", "workflow_url")}


async def test_what_a_preempted_item_carries_is_vllms_own(quiet, vllm_run):
    """Items with logprobs, penalties, biases, stop token ids, vLLM's sampling extras,
    structured outputs, tool calls and several choices (each choice its own generation),
    each preempted half way through its output (by the gate and a burst of chat), finish
    equal to vLLM's own uninterrupted answers to the same lines:
    text, finish reason, usage and logprobs; the structured ones valid against their
    schemas by a validator that is not the engine's."""
    stack, db_url = quiet
    theirs = await asyncio.to_thread(vllm_run.results)
    ok = {cid: t["response"]["body"] for cid, t in theirs.items() if t["response"]["status_code"] == 200}
    # Several choices where each is greedy's text (top_k 1): a sampled one resumes as
    # another sample, not vLLM's.
    lines = [ln for ln in oracle.CHAT_LINES if (ln["custom_id"].startswith(("s-", "j-", "t-"))
                                               or ln["custom_id"].startswith("n-") and ln["body"].get("top_k") == 1)
             and ln["custom_id"] in ok and oracle.tokens_of(ok[ln["custom_id"]]) >= 4]
    choices = [ln["body"].get("n", 1) for ln in lines]
    n = 32  # every slot (a choice takes one), so that a burst of chat preempts all of them
    fill = [chat_line(f"fill-{i}", f"fill {i}", LENGTH, ignore_eos=True) for i in range(n - sum(choices))]
    try:
        stack.gate.hold(0)
        client = stack.openai()
        batch = await asyncio.to_thread(submit, client, lines + fill)
        # Half of each choice's tokens (a greedy item's choices have one text); choice c of an
        # item is held as "<item>#c".
        budgets = {keys.item(batch.id, i) + (f"#{c}" if c else ""): oracle.tokens_of(ok[ln["custom_id"]]) // k // 2
                   for i, (ln, k) in enumerate(zip(lines, choices, strict=True)) for c in range(k)}
        budgets |= {keys.item(batch.id, len(lines) + i): 8 for i in range(len(fill))}
        await preempt_at(stack, db_url, batch.id, budgets, n)
        stack.gate.release()
        b = await asyncio.to_thread(wait_for, client, batch.id)
    finally:
        stack.gate.release()
    assert b.status == "completed", b
    preempted = preempted_offsets(db_url, batch.id)
    # Each yielded where the gate held it (an item's choices, all at one budget, each once).
    assert all(preempted[item.split("#")[0]][0] == at for item, at in budgets.items())
    assert all(len(preempted[keys.item(batch.id, i)]) >= k for i, k in enumerate(choices))
    ours = {o["custom_id"]: o for o in await asyncio.to_thread(read_jsonl, client, b.output_file_id)}
    (vllm_run.root / "preempted.out.jsonl").write_text(oracle._jsonl(list(ours.values())))  # beside vLLM's, to read
    # vLLM computes logprobs before its logits processors run, and masks a grammar before
    # that: a resumed grammar (masked by engine/logits.py, a processor) has the logprobs of
    # the unmasked logits from the resume on. Its tokens, text and usage are vLLM's.
    grammar_logprobs = {ln["custom_id"] for ln in lines if "logprobs" in ln["body"] and (
        ln["custom_id"].startswith("j-") or ln["body"].get("tool_choice") not in (None, "none", "auto"))}
    for cid in grammar_logprobs:
        cut = budgets[keys.item(batch.id, [ln["custom_id"] for ln in lines].index(cid))]  # one choice: its own
        mine, vllms = (x["response"]["body"]["choices"][0]["logprobs"]["content"] for x in (ours[cid], theirs[cid]))
        assert oracle.close(mine[:cut], vllms[:cut]) and not oracle.close(mine[cut:], vllms[cut:]), cid
        for x in (ours[cid], theirs[cid]):
            x["response"]["body"]["choices"][0]["logprobs"] = None
    diffs = [d for ln in lines for d in oracle.compare(ln["custom_id"], ours[ln["custom_id"]], theirs[ln["custom_id"]])]
    assert not diffs, "\n".join(diffs)
    assert grammar_logprobs == {"j-person-penalised", "t-required-one"}
    oracle.valid_structured({cid: o["response"]["body"] for cid, o in ours.items() if cid.startswith("j-")})
    oracle.valid_calls({cid: o["response"]["body"] for cid, o in ours.items() if cid.startswith("t-")})
    assert len(lines) >= 22 and sum(choices) - len(lines) == 2, [ln["custom_id"] for ln in lines]
    assert_nothing_lost_and_never_two_at_once(db_url, batch.id)
