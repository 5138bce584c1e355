"""The chaos suite, CI-sized (`ballast chaos --minutes N` is the long one): a fresh
`ballast up` under a batch pump and a stream of chats, with its engine worker SIGKILLed,
its Postgres restarted every few seconds, its Temporal server and API SIGKILLed (the API
mid-stream) and its object store filled during a batch's finalization.

Afterwards, from outside the code under test: the journal's invariants in SQL; by the
client's own record of what it sent (the input lines it wrote, per file), every item
exactly once in a completed batch's output and error files as downloaded through the API,
no other ids, request_counts equal; every item's text equal to vLLM's own greedy output
for the very line the client sent (vLLM's batch runner in a process of its own, after the
run), however often its generation was cut; every chat the client saw journaled; no
stream that ended in an error or broke while no fault was in effect; no 500 and no hang;
every fault recovered from. (How a stream is read and judged: tests/test_chaos_client.py.)"""

from __future__ import annotations

import json

import pytest

from bench import chaos
from config import Settings
from journal.invariants import report

pytestmark = pytest.mark.e2e

PLAN = chaos.Plan(engine=2, postgres=4, temporal=1, api=1, store=1, items=24, max_tokens=48)


def test_faults_under_load_lose_nothing_and_duplicate_nothing(tiny_model):
    settings = Settings(model=tiny_model.path, served_model_name=tiny_model.name,
                        max_model_len=tiny_model.max_model_len, kv_cache_gib=0.5)
    run = chaos.run(settings, PLAN, at_rest_timeout=120, BALLAST_UNREPORTED_AFTER_S="15")
    r = run.report
    summary = r.summary()
    print(json.dumps(summary, indent=2))
    assert r.ok, "\n".join(r.failures()) + "\n" + report(r.findings)
    assert {f: summary[f]["injected"] for f in chaos.FAULTS} == dict(engine=2, postgres=4, temporal=1, api=1, store=1)
    assert summary["batches"].get("completed", 0) >= 3 and set(summary["batches"]) == {"completed"}, summary

    # The client's own record: every line it sent came back once, as an answer (none failed),
    # in the files of a completed batch; nothing it did not send; the counts agree.
    acc = summary["client"]
    assert acc["items_submitted"] >= 3 * PLAN.items
    assert acc["items_once"] == acc["items_output"] == acc["items_submitted"], acc
    assert acc["items_lost"] == acc["items_duplicated"] == acc["items_extra"] == acc["items_error"] == 0, acc
    assert acc["batches_listed"] == acc["batches_completed"] == acc["batches_counts_equal"] == len(r.batches), acc
    assert acc["batches_missing"] == acc["batches_foreign"] == 0, acc

    # Every item's text is vLLM's greedy output for its line: nothing lost or doubled inside
    # an item either, across kills and restarts.
    greedy = summary["greedy"]
    assert greedy["checked"] == acc["items_output"] and greedy["equal"] == greedy["checked"], greedy

    # Chats went on throughout, each one journaled; none ended badly while no fault was in
    # effect; those cut by the API's death or sent while it was down count as interrupted.
    chats = summary["chats"]
    assert chats.get("failed", 0) == 0 and chats["ok"] >= 10, summary["chat_endings"]
    assert summary["api"]["calls"].get("chat interrupted", 0) >= 1, summary  # while the API was down
    # The chat streaming when the API was killed was cut: interrupted, not ok.
    assert [i.note for i in r.injections if i.fault == "api"] in (["the chat streaming: dropped"],
                                                                  ["the chat streaming: cut"]), r.injections
    assert r.chats_journaled >= 10
