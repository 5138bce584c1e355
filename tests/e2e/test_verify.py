"""`ballast verify` and the audit queries of docs/quotas-and-audit.md on a journal that real work wrote: a batch
(some of its text holding NUL, some lines with stop strings, one line that cannot run), chats
(streamed, not, one the client left mid-stream) and a completion, and a fine-tuning job that
checkpointed three times, on a stack and database of their own.

At rest, every invariant holds and every one examined rows (the training one included, and
with the model's tokenizer each item's prompt re-tokenized); the CLI says so and exits 0.
The doc's audit queries run as written, as its auditor login inside a tenant's transaction:
those that list problems return none, the others return rows."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from config.database import as_role, libpq_url
from journal.invariants import CHECKS, RETOKENIZED, audit, passed, report
from tests.e2e.conftest import WAIT_S, own_stack
from tests.e2e.test_batch import chat_line, submit, wait_for
from tests.e2e.test_fine_tuning import CHATS, wait_final

pytestmark = pytest.mark.e2e

AUDIT_DOC = Path(__file__).resolve().parents[2] / "docs" / "quotas-and-audit.md"
# Prompts whose greedy answer on the tiny model holds a NUL within 48 tokens (found with
# transformers), among others: Postgres's JSON functions refuse such text.
PROMPTS = [f"Request {i}: tell me about things" for i in range(24)]


@pytest.fixture(scope="module")
def books(tmp_path_factory, pg_server_url, temporal_address, tiny_model):
    """(the stack, its database's owner URL), once everything it ran has ended and been
    swept. Fine-tuning chunks of 2 steps, no longer: 10 chats in batches of 4, 2 epochs,
    checkpoints at steps 2, 4 and 6."""
    with own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "verify",
                   BALLAST_FINE_TUNE_CHUNK_STEPS="2", BALLAST_FINE_TUNE_CHECKPOINT_OVERHEAD="0") as (stack, url):
        client = stack.openai()
        lines = [chat_line(f"i-{n}", p, 48, **(dict(stop=["\n"]) if n % 3 == 0 else {}))
                 for n, p in enumerate(PROMPTS)]
        lines.append(chat_line("too-long", "fine", 5000))  # beyond the context: the error file
        batch = submit(client, lines)
        train = client.files.create(file=("train.jsonl", io.BytesIO(
            "".join(json.dumps(dict(messages=c)) + "\n" for c in CHATS).encode())), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model="ballast-tiny", training_file=train.id, seed=3,
                                             hyperparameters=dict(n_epochs=2, batch_size=4))
        chat = dict(model="ballast-tiny", messages=[dict(role="user", content="Hi")], max_tokens=32)
        client.chat.completions.create(**chat)
        for _ in client.chat.completions.create(**chat, stream=True):
            pass
        client.completions.create(model="ballast-tiny", prompt="Once", max_tokens=16)
        left = client.chat.completions.create(**dict(chat, max_tokens=400), stream=True,
                                              extra_body=dict(ignore_eos=True))
        next(iter(left))
        left.close()  # the client leaves mid-stream: the API settles what it relayed
        assert wait_for(client, batch.id).status == "completed"
        assert wait_final(client, job.id).status == "succeeded"
        deadline = time.monotonic() + WAIT_S  # requests journal and settle off the request path
        while not passed(found := audit(url)) or not all(f.examined for f in found):
            assert time.monotonic() < deadline, report(found)
            time.sleep(1)
        yield stack, url


def test_verify_passes_and_every_check_examined_rows(books, tiny_model):
    _, url = books
    # With the model's tokenizer too: each item's prompt re-tokenized by transformers
    # against what vLLM counted.
    found = audit(url, tokenizer=tiny_model.path)
    assert [f.check.name for f in found] == [c.name for c in (*CHECKS, RETOKENIZED)]
    assert all(f.ok and f.examined > 0 for f in found), report(found)
    by_name = {f.check.name: f.examined for f in found}
    assert by_name["training_tokens_match_checkpoints"] >= 3  # steps 2, 4, 6 (and any a chat preempted)
    assert by_name["item_tokens_match_chunks"] == len(PROMPTS) + 1  # the line that cannot run settles nothing
    assert by_name["item_prompts_retokenized"] == len(PROMPTS)
    assert by_name["request_tokens_match_engine"] == 4
    env = dict(os.environ, BALLAST_DATABASE_URL=url)
    done = subprocess.run([sys.executable, "-m", "ballast.cli", "verify", "--tokenizer", tiny_model.path], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    for check in (*CHECKS, RETOKENIZED):
        (line,) = [ln for ln in out if ln.startswith(f"ok   {check.name}: ")]
        assert re.search(rf"\(([1-9][0-9,]*) {check.unit} examined\)$", line), line
    assert out[-1].startswith(f"passed: {len(CHECKS) + 1} checks over ")


def _audit_queries() -> list[tuple[str, str]]:
    """The audit section of docs/quotas-and-audit.md: each SQL block with the paragraph before it."""
    section = AUDIT_DOC.read_text().split("## Auditing quota usage in SQL", 1)[1].split("\n## ", 1)[0]
    out, after = [], 0
    for m in re.finditer(r"```sql\n(.*?)```", section, re.S):
        out.append((section[after:m.start()].strip().split("\n\n")[-1], m.group(1)))
        after = m.end()
    return out


def test_documented_audit_queries_run_as_written_on_real_data(books):
    _, url = books
    with psycopg.connect(libpq_url(url), autocommit=True) as owner:
        # Some of the batch's text holds NUL: what JSON casts of the response refuse.
        assert owner.execute("SELECT count(*) FROM events WHERE type = 'item_completed' "
                             "AND position('\\u0000' IN payload->>'body_json') > 0").fetchone() != (0,)
        login, password = f"audit_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
        owner.execute(f"CREATE ROLE {login} LOGIN PASSWORD '{password}' IN ROLE ballast_auditor")
    queries = _audit_queries()
    assert len(queries) >= 7
    try:
        with psycopg.connect(libpq_url(as_role(url, login, password))) as auditor:
            for before, sql in queries:
                assert "…" not in sql and not re.search(r"<\w+>", sql), sql  # runnable as written: no placeholder
                with auditor.transaction():  # as the doc says: the tenant set for this transaction only
                    auditor.execute("SELECT set_config('ballast.tenant', 'default', true)")
                    rows = auditor.execute(sql).fetchall()
                if "expect no rows" in before:
                    assert rows == [], (sql, rows)
                else:
                    assert rows, sql
    finally:
        with psycopg.connect(libpq_url(url), autocommit=True) as owner:
            owner.execute(f"DROP ROLE {login}")
