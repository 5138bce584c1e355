"""The chaos suite, CI-sized (`ballast chaos --minutes N` is the long one): a fresh
`ballast up` under a batch pump and a stream of chats, with its engine worker SIGKILLed,
its Postgres restarted every few seconds, its Temporal server and API SIGKILLed (the API
mid-stream) and its object store filled during a batch's finalization.

Afterwards, from outside the code under test: the journal's invariants in SQL, each
batch's files holding each item once, every chat the client saw journaled, no 500 and no
hang, every fault recovered from; and every batch item's text equal to vLLM's own greedy
output for its prompt, however often its generation was cut."""

from __future__ import annotations

import asyncio

import pytest

from ballast.settings import Settings
from bench import chaos
from journal.invariants import report
from tests.e2e.test_batch import greedy

pytestmark = pytest.mark.e2e

PLAN = chaos.Plan(engine=2, postgres=4, temporal=1, api=1, store=1, items=24, max_tokens=48)


async def test_faults_under_load_lose_nothing_and_duplicate_nothing(tiny_model, engine):
    settings = Settings(model=tiny_model.path, served_model_name=tiny_model.name,
                        max_model_len=tiny_model.max_model_len)
    # Off the event loop: the run blocks for minutes, and the reference outputs need it after.
    run = await asyncio.to_thread(chaos.run, settings, PLAN, at_rest_timeout=120,
                                  BALLAST_MAX_MODEL_LEN=str(tiny_model.max_model_len), BALLAST_KV_CACHE_GIB="0.5",
                                  BALLAST_UNREPORTED_AFTER_S="15")
    r = run.report
    assert r.ok, "\n".join(r.failures()) + "\n" + report(r.findings)
    summary = r.summary()
    assert {f: summary[f]["injected"] for f in chaos.FAULTS} == dict(engine=2, postgres=4, temporal=1, api=1, store=1)
    assert summary["batches"].get("completed", 0) >= 3 and set(summary["batches"]) == {"completed"}, summary
    assert r.chats_journaled >= 10  # the client's chats went on throughout, and each one is in the journal

    # Every item's text is vLLM's greedy output for its prompt: nothing lost or doubled
    # inside an item either, across kills and restarts.
    assert len(run.outputs) == r.batch_items
    ids = sorted(run.outputs)
    expected = await asyncio.gather(*(greedy(engine, run.prompts[i], PLAN.max_tokens, ignore_eos=True) for i in ids))
    wrong = [i for i, want in zip(ids, expected, strict=True) if run.outputs[i] != want]
    assert not wrong, f"{len(wrong)} of {len(ids)} items differ from vLLM's greedy output, e.g. {wrong[:3]}"
