"""The journal's invariants (journal/invariants.py) pass on a journal that keeps them,
examining its rows, and each one names the rows of a journal that breaks it, written by
hand here: the oracle is the broken row itself, not the code that would have written it.
An empty journal, and a role that row-level security hides every row from, do not pass."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

from ballast.cli import main as ballast
from config.database import as_role, libpq_url
from journal.invariants import CHECKS, audit, examined, passed, report
from tests.conftest import migrated_database
from tests.helpers import uid

# The events an attempt writes under its item's (or job's) lease: the database refuses
# them without the stream's current fence.
_FENCED = ("item_chunk", "item_preempted", "item_completed", "item_failed", "ft_checkpoint")


@pytest.fixture(scope="module")
def journal_url(pg_server_url):
    """A database of its own: the checks read every row, and other tests write odd ones."""
    with migrated_database(pg_server_url, "ballast_invariants") as url:
        yield url



class Journal:
    def __init__(self, url: str):
        self.conn = psycopg.connect(libpq_url(url), autocommit=True)
        self.versions: dict[str, int] = {}

    def scalar(self, sql: str, params: tuple) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        assert row is not None
        return row[0]

    def lease(self, stream: str) -> int:
        """The stream's next fencing token, as an attempt takes it (the database may assign
        the token itself: the one it returns is the one to carry)."""
        return self.scalar("INSERT INTO leases (stream, token, holder) VALUES (%s, 1, 'test') "
                           "ON CONFLICT (stream) DO UPDATE SET token = leases.token + 1 RETURNING token", (stream,))

    def event(self, stream: str, type_: str, payload: dict, key: str | None = None, fence: int | None = None) -> int:
        if fence is None and type_ in _FENCED:
            fence = self.lease(stream)
        self.versions[stream] = v = self.versions.get(stream, 0) + 1
        return self.scalar("INSERT INTO events (stream, version, type, payload, idempotency_key, tenant, fence) "
                           "VALUES (%s, %s, %s, %s, %s, 't', %s) RETURNING position",
                           (stream, v, type_, json.dumps(payload), key or f"{stream}:{v}", fence))

    def ledger(self, subject: str, kind: str, i: int, o: int, tier: str = "default") -> None:
        self.conn.execute("INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, "
                          "idempotency_key) VALUES ('t', 'm', %s, %s, %s, %s, %s, %s)",
                          (tier, subject, kind, i, o, f"{kind}:{subject}"))

    def batch(self, status: str, items: int, output: str | None = None, body: dict | None = None,
              endpoint: str = "/v1/chat/completions", bodies: list[dict] | None = None) -> str:
        """`items` items, each of `body` (or of its own in `bodies`)."""
        bid = uid("batch")
        self.conn.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, "
                          "output_file_id, created_at, seq) VALUES (%s, 't', %s, 'f', '24h', %s, %s, 0, 0)",
                          (bid, endpoint, status, output))
        for idx in range(items):
            self.conn.execute("INSERT INTO batch_items (batch_id, idx, line, custom_id, body, status) "
                              "VALUES (%s, %s, %s, %s, %s, 'pending')",
                              (bid, idx, idx + 1, f"c{idx}", json.dumps(bodies[idx] if bodies else body or {})))
        return bid

    def file(self) -> str:
        fid = uid("file")
        self.conn.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, object_key, created_at) "
                          "VALUES (%s, 't', 'batch_output', 'out.jsonl', 1, %s, 0)", (fid, f"files/{fid}"))
        return fid

    def item(self, bid: str, idx: int, chunks: list[tuple[int, int]], result: str | None = "item_completed",
             usage: tuple[int, int] | None = None, settled: tuple[int, int] | None = None) -> str:
        """Its chunks of (offset, tokens), its result with `usage` in the body (default: the
        tokens journaled), projected and settled as the product does (`settled`: otherwise)."""
        stream = f"item:{bid}:{idx}"
        for offset, n in chunks:
            self.event(stream, "item_chunk", dict(batch_id=bid, idx=idx, offset=offset, token_ids=list(range(n))))
        if result:
            usage = usage or (5, sum(n for _, n in chunks))
            # Generated text may hold NUL (a byte-level model's), and quotes.
            body = dict(choices=[dict(message=dict(content='a\0"prompt_tokens": 99'))],
                        usage=dict(prompt_tokens=usage[0], completion_tokens=usage[1]))
            pos = self.event(stream, result, dict(batch_id=bid, idx=idx, body_json=json.dumps(body)),
                             f"{stream}:result")
            self.conn.execute("UPDATE batch_items SET status = %s, result_position = %s WHERE batch_id = %s "
                              "AND idx = %s", (result.removeprefix("item_"), pos, bid, idx))
            self.ledger(stream, "settle", *(settled or (usage if result == "item_completed" else (0, 0))),
                        tier="batch")
        return stream

    def request(self, rid: str, i: int, o: int, finished: bool = True, settled: tuple[int, int] | None = None,
                status: str = "completed") -> None:
        """Served by an engine (its record: i, o), journaled by the API as `status` with the
        tokens `settled` (default: the engine's)."""
        self.event(f"served:{rid}", "request_served", dict(request_id=rid, prompt_tokens=i, completion_tokens=o))
        if finished:
            i_, o_ = settled or (i, o)
            self.event(f"request:{rid}", "request_finished",
                       dict(request_id=rid, status=status, prompt_tokens=i_, completion_tokens=o_),
                       f"request:{rid}:finished")
            self.ledger(f"request:{rid}", "reserve", i, 16)
            self.ledger(f"request:{rid}", "settle", i_, o_)

    def fine_tune(self, job: str, epochs: int, per_epoch: int, total_steps: int, settles: dict[int, int],
                  trained: int | None = None) -> None:
        """A job of `epochs` over `per_epoch` tokens, a checkpoint at each step of
        `settles` with its settle, and (`trained`) its success as reported."""
        stream = f"ftjob:{job}"
        self.event(stream, "ft_job_created", dict(id=job, hyperparameters=dict(n_epochs=epochs, batch_size=4)),
                   f"{stream}:created")
        for step, tokens in settles.items():
            self.event(stream, "ft_checkpoint", dict(job_id=job, step=step, tokens_per_epoch=per_epoch,
                                                     total_steps=total_steps), f"{stream}:checkpoint:{step}")
            self.ledger(f"{stream}:{step}", "settle", tokens, 0, tier="training")
        if trained is not None:
            self.event(stream, "ft_status", dict(job_id=job, status="succeeded", trained_tokens=trained),
                       f"{stream}:status:9")


@pytest.fixture(scope="module")
def journal(journal_url):
    j = Journal(journal_url)
    # A journal that keeps every invariant: a completed batch (an item of two chunks, an
    # item of one, a failed one), a request served and settled, one cut short, a job
    # trained in three checkpoints (10 examples of 100 tokens in all, batches of 4: 3 steps
    # an epoch, 2 epochs) that succeeded.
    bid = j.batch("completed", 3, output=j.file())
    j.item(bid, 0, [(0, 3), (3, 4)])
    j.item(bid, 1, [(0, 7)])
    j.item(bid, 2, [(0, 2)], result="item_failed")
    j.request("chatcmpl-good", 9, 4)
    j.request("chatcmpl-cut", 9, 12, settled=(9, 5), status="cancelled")  # the client left: the API had relayed 5
    j.fine_tune("ftjob-good", 2, 100, 6, {2: 70, 4: 60, 6: 70}, trained=200)
    yield j
    j.conn.close()


def findings(url: str, name: str):
    (found,) = [f for f in audit(url, examples=1000) if f.check.name == name]
    return found


def violations(url: str, name: str) -> list[tuple]:
    return findings(url, name).examples


def test_a_journal_that_keeps_them_passes_every_check_and_examines_its_rows(journal, journal_url):
    found = audit(journal_url)
    assert {f.check.name: f.violations for f in found} == {c.name: 0 for c in CHECKS}
    # What each examined, counted by hand from the fixture.
    assert {f.check.name: f.examined for f in found} == dict(
        item_results_once=3, chunks_contiguous=4, fences_only_rise=4 + 3 + 3, completed_batches_have_files=1,
        ledger_equals_journal=2 * (3 + 2 + 3), request_tokens_match_engine=2, item_tokens_match_chunks=3,
        training_tokens_match_checkpoints=3, batches_ended=1, requests_accounted=2, reservations_closed=2)
    assert passed(found)
    text = report(found)
    assert "ok   item_results_once: " in text and "(3 items examined)" in text
    assert text.splitlines()[-1] == "passed: 11 checks over 47 rows"


def test_an_item_without_its_result_with_a_second_one_or_whose_read_model_differs_is_named(journal, journal_url):
    missing = journal.batch("completed", 1, output=journal.file())  # no result, its batch completed
    running = journal.batch("in_progress", 1)  # no result yet: fine while it runs
    twice = journal.batch("completed", 1, output=journal.file())
    journal.item(twice, 0, [(0, 2)])
    second = journal.event(f"item:{twice}:0", "item_failed", dict(batch_id=twice, idx=0, body_json="{}"))
    unseen = journal.batch("in_progress", 1)
    journal.item(unseen, 0, [(0, 2)])
    journal.conn.execute("UPDATE batch_items SET status = 'pending' WHERE batch_id = %s", (unseen,))
    orphan = journal.event("item:batch_gone:0", "item_completed", dict(batch_id="batch_gone", idx=0, body_json="{}"),
                           "item:batch_gone:0:result")
    rows = violations(journal_url, "item_results_once")
    assert {(r[0], r[4]) for r in rows} == {(f"item:{missing}:0", None), (f"item:{twice}:0", second),
                                            (f"item:{unseen}:0", _result(journal, unseen)),
                                            ("item:batch_gone:0", orphan)}
    assert f"item:{running}:0" not in {r[0] for r in rows}


def _result(journal: Journal, bid: str) -> int:
    return journal.scalar("SELECT position FROM events WHERE idempotency_key = %s", (f"item:{bid}:0:result",))


def test_a_gap_or_an_overlap_in_an_items_chunks_is_named(journal, journal_url):
    bid = journal.batch("in_progress", 3)
    journal.item(bid, 0, [(0, 4), (6, 2)], result=None)  # tokens 4-5 never journaled
    journal.item(bid, 1, [(0, 4), (3, 2)], result=None)  # token 3 twice
    journal.item(bid, 2, [(2, 2)], result=None)  # not from 0
    # Item 2's second choice: whole on its own (its offsets are its own, not choice 0's).
    for offset in (0, 3):
        journal.event(f"item:{bid}:2", "item_chunk", dict(batch_id=bid, idx=2, offset=offset, token_ids=[7, 8, 9],
                                                          runner="r", choice=1), f"item:{bid}:2:chunk:1:{offset}")
    rows = violations(journal_url, "chunks_contiguous")
    assert sorted(rows) == [(f"item:{bid}:0", 0, 6, 4), (f"item:{bid}:1", 0, 3, 4), (f"item:{bid}:2", 0, 2, 0)]


def test_an_event_from_an_older_attempt_after_a_newer_ones_is_named(journal, journal_url):
    # The database refuses this (its fencing trigger); the check is for journals that did
    # not pass through it: a restore, a copy, a trigger disabled.
    stream = "item:fenced:0"
    journal.conn.execute("SET session_replication_role = replica")
    try:
        journal.event(stream, "item_chunk", dict(offset=0, token_ids=[1]), fence=2)
        journal.event(stream, "item_chunk", dict(offset=1, token_ids=[2]), fence=1)
    finally:
        journal.conn.execute("SET session_replication_role = DEFAULT")
    assert [(r[0], r[2], r[3]) for r in violations(journal_url, "fences_only_rise")] == [(stream, 1, 2)]


def test_a_completed_batch_without_its_file_is_named(journal, journal_url):
    nothing = journal.batch("completed", 0)
    dangling = journal.batch("completed", 0, output="file-that-was-never-written")
    assert {r[0] for r in violations(journal_url, "completed_batches_have_files")} == {nothing, dangling}


def test_a_settle_of_nothing_journaled_an_outcome_never_settled_or_a_wrong_tier_is_named(journal, journal_url):
    journal.ledger("request:chatcmpl-phantom", "settle", 1, 1)  # settled, never journaled
    journal.ledger("ftjob:ftjob-phantom:3", "settle", 10, 0, tier="training")  # no such checkpoint
    bid = journal.batch("in_progress", 1)
    journal.event(f"item:{bid}:0", "item_completed", dict(batch_id=bid, idx=0, body_json="{}"),
                  f"item:{bid}:0:result")  # a result never settled
    journal.ledger(f"item:{bid}:1", "settle", 0, 0, tier="default")  # neither journaled nor in batch's tier
    mine = ("request:chatcmpl-phantom", "ftjob:ftjob-phantom:3", f"item:{bid}:0", f"item:{bid}:1")
    rows = {r[0]: r[1:] for r in violations(journal_url, "ledger_equals_journal") if r[0] in mine}
    assert rows == {"request:chatcmpl-phantom": (None, "default"), "ftjob:ftjob-phantom:3": (None, "training"),
                    f"item:{bid}:0": ("item", None), f"item:{bid}:1": (None, "default")}


def test_a_request_settled_otherwise_than_its_engine_counted_is_named(journal, journal_url):
    journal.request("chatcmpl-skewed", 9, 4, settled=(9, 5))  # completed: must be the engine's 4
    journal.request("chatcmpl-prompt", 9, 4, settled=(8, 4))
    journal.request("chatcmpl-more", 9, 4, settled=(9, 6), status="cancelled")  # more than the engine made
    journal.request("chatcmpl-less", 9, 4, settled=(9, 1), status="failed")  # cut short: fine
    rows = violations(journal_url, "request_tokens_match_engine")
    assert sorted(rows) == [("chatcmpl-more", "cancelled", 9, 6, 9, 4), ("chatcmpl-prompt", "completed", 8, 4, 9, 4),
                            ("chatcmpl-skewed", "completed", 9, 5, 9, 4)]


def test_an_item_settled_otherwise_than_its_chunks_journaled_is_named(journal, journal_url):
    bid = journal.batch("completed", 2, output=journal.file())
    journal.item(bid, 0, [(0, 3), (3, 4)], settled=(5, 8))  # 7 token ids journaled
    journal.item(bid, 1, [(0, 2)], result="item_failed", settled=(5, 2))  # a failed item uses nothing
    stops = journal.batch("completed", 2, output=journal.file(), body=dict(stop=["\n"]))
    journal.item(stops, 0, [(0, 7)], usage=(5, 6))  # a stop string found before the last token: fine
    journal.item(stops, 1, [(0, 7)], usage=(5, 8))  # never more than journaled
    rows = [r for r in violations(journal_url, "item_tokens_match_chunks") if bid in r[0] or stops in r[0]]
    assert sorted(rows) == sorted([(f"item:{bid}:0", "item_completed", 5, 8, 7, False),
                                   (f"item:{bid}:1", "item_failed", 5, 2, 2, False),
                                   (f"item:{stops}:1", "item_completed", 5, 8, 7, True)])


def test_a_training_settle_beyond_the_epochs_trained_or_the_tokens_reported_is_named(journal, journal_url):
    journal.fine_tune("ftjob-over", 2, 100, 6, {2: 70, 4: 60, 6: 80}, trained=200)  # 210 after two epochs
    journal.fine_tune("ftjob-early", 2, 100, 6, {2: 101})  # more than an epoch holds, within the first
    journal.fine_tune("ftjob-told", 2, 100, 6, {3: 100, 6: 100}, trained=300)  # it reported 300
    rows = violations(journal_url, "training_tokens_match_checkpoints")
    assert set(rows) == {("checkpoint", "ftjob-over", 6, 210, 200, 200, 0),
                         ("succeeded", "ftjob-over", None, 210, 200, 200, None),
                         ("checkpoint", "ftjob-early", 2, 101, 0, 100, 0),
                         ("succeeded", "ftjob-told", None, 200, 300, 300, None)}


def test_with_a_tokenizer_an_item_settled_otherwise_than_its_prompt_re_tokenized_is_named(journal, journal_url,
                                                                                          tiny_model):
    # The tiny model's tokenizer is byte-level: a prompt is BOS and a token per UTF-8
    # byte; a chat is BOS, then per message its role marker, its bytes and a newline, then
    # the assistant's marker (engine/tiny.py's template). Counted by hand here.
    prompts = [("Once", 1 + 4), ("Zürich", 1 + 7), ([1, 2, 3], 3)]
    done = journal.batch("completed", 3, output=journal.file(), endpoint="/v1/completions",
                         bodies=[dict(model="m", prompt=p) for p, _ in prompts])
    for idx, (_, n) in enumerate(prompts):
        journal.item(done, idx, [(0, 2)], usage=(n, 2))
    hi = dict(model="m", messages=[dict(role="user", content="Hi")])
    parts = dict(model="m", messages=[dict(role="user", content=[dict(type="text", text="H"),
                                                                 dict(type="text", text="i")])])
    chats = journal.batch("completed", 3, output=journal.file(), bodies=[hi, parts, hi])
    journal.item(chats, 0, [(0, 2)], usage=(1 + 1 + 2 + 1 + 1, 2))
    journal.item(chats, 1, [(0, 2)], usage=(6, 2))
    journal.item(chats, 2, [(0, 2)], usage=(7, 2))  # one more than the request holds
    (found,) = [f for f in audit(journal_url, tokenizer=tiny_model.path) if f.check.name == "item_prompts_retokenized"]
    assert found.examples == [(f"item:{chats}:2", 7, 6)] and found.violations == 1
    assert found.examined == 6  # the other tests' items have no prompt to render
    assert "item_prompts_retokenized" not in {f.check.name for f in audit(journal_url)}  # only with a tokenizer


def test_at_rest_a_running_batch_an_unjournaled_request_and_an_open_reservation_are_named(journal, journal_url):
    running = journal.batch("in_progress", 0)
    journal.request("chatcmpl-lost", 3, 2, finished=False)
    journal.ledger("request:chatcmpl-open", "reserve", 3, 8)
    assert running in [r[0] for r in violations(journal_url, "batches_ended")]  # with the earlier tests' ones
    assert [r[0] for r in violations(journal_url, "requests_accounted")] == ["chatcmpl-lost"]
    assert [r[0] for r in violations(journal_url, "reservations_closed")] == ["request:chatcmpl-open"]
    ended = {r[0] for r in violations(journal_url, "batches_ended")}
    assert not ended & {r[0] for r in journal.conn.execute("SELECT id FROM batches WHERE status = 'completed'")}
    # Not while things run: those checks are left out.
    assert {f.check.name for f in audit(journal_url, at_rest=False)} == {c.name for c in CHECKS if not c.at_rest}
    assert not passed(audit(journal_url))


def test_an_empty_journal_does_not_pass(pg_server_url, monkeypatch, capsys):
    with migrated_database(pg_server_url, "ballast_invariants_empty") as url:
        found = audit(url)
        assert all(f.ok and f.examined == 0 and f.state == "none" for f in found) and not passed(found)
        monkeypatch.setenv("BALLAST_DATABASE_URL", url)
        assert ballast(["verify"]) == 1
    out = capsys.readouterr().out
    assert "none item_results_once: " in out and "nothing to check (0 items examined)" in out
    assert out.splitlines()[-1].startswith("FAILED: nothing examined")


def test_a_role_that_row_level_security_hides_everything_from_does_not_pass(journal, journal_url, monkeypatch,
                                                                              capsys):
    # The auditor role sees only the tenant set for its transaction; verify sets none.
    assert examined(audit(journal_url)) > 0  # the owner sees what it checks
    login, password = f"audit_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex  # a bare SQL identifier
    with psycopg.connect(libpq_url(journal_url), autocommit=True) as owner:
        owner.execute(f"CREATE ROLE {login} LOGIN PASSWORD '{password}' IN ROLE ballast_auditor")
    try:
        url = as_role(journal_url, login, password)
        found = audit(url, at_rest=False)
        assert not passed(found)
        assert all(f.state != "ok" for f in found), report(found)
        monkeypatch.setenv("BALLAST_DATABASE_URL", url)
        assert ballast(["verify"]) == 1
        assert "FAILED" in capsys.readouterr().out.splitlines()[-1]
    finally:
        with psycopg.connect(libpq_url(journal_url), autocommit=True) as owner:
            owner.execute(f"DROP ROLE {login}")
