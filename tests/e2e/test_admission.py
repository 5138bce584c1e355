"""Quotas on the real stack: the ledger settles exactly what the journal records, for
interactive requests (completed, streamed, dropped by the client) and batch items alike,
and a batch over the tenant's enqueued-token limit fails validation as OpenAI's does.

Each test runs as a tenant of its own (a key made in the stack's database), so the
limits it sets touch no other test.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.e2e.conftest import WAIT_S, make_key, vllm_paused
from tests.e2e.test_batch import _sql, chat_line, submit, wait_for

pytestmark = pytest.mark.e2e


def tenant_client(stack, db_url: str, prefix: str):
    from openai import OpenAI

    tenant = f"{prefix}-{uuid.uuid4().hex[:8]}"
    key = make_key(db_url, tenant)
    return tenant, key, OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


@contextlib.contextmanager
def held_stream(stack, url: str, key: str, body: dict, *, text: bool) -> Iterator[tuple[dict, Callable[[], None]]]:
    """A streamed chat whose first chunk (with text, if `text`) has reached the client:
    that chunk, and `walk_away()` to close the connection. vLLM runs only in nudges of a
    few steps until then and stays paused for the block, so the request is still
    mid-generation whatever the machine's speed (left to run, the tiny model can finish
    its 1,000 tokens before a loaded machine delivers the first one to the client)."""
    first: list[dict] = []
    read, gone = threading.Event(), threading.Event()

    def client() -> None:
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S) as h, \
                    h.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: "):])
                        if not text or (chunk["choices"] and chunk["choices"][0]["delta"].get("content")):
                            first.append(chunk)
                            read.set()
                            gone.wait(WAIT_S)
                            return
        finally:
            read.set()

    reader = threading.Thread(target=client, daemon=True)

    def walk_away() -> None:
        gone.set()
        reader.join(WAIT_S)

    deadline, patience = time.monotonic() + WAIT_S, 0.1
    with vllm_paused(stack) as nudge:
        reader.start()
        # Each nudge is followed by a longer wait: on a loaded machine a token vLLM made
        # can take a second to reach the client, and nudging on meanwhile would let the
        # tiny model finish all its tokens before the client holds its first.
        while not read.wait(patience):
            assert time.monotonic() < deadline, "no first token"
            nudge(0.01)
            patience = min(2 * patience, 2.0)
        assert first, "the stream ended before its first token"
        try:
            yield first[0], walk_away
        finally:
            walk_away()


def dropped_stream(stack, key: str, db_url: str, tenant: str) -> list[str]:
    """Streamed chats the client walks away from after its first token: their ids, the last
    one cancelled mid-generation. A nudge of vLLM can outlast its few steps on a loaded
    machine (the test is not scheduled back in time) and let the tiny model finish before
    the client walks away; such a try is journaled as completed and tried again."""
    body = dict(model="ballast-tiny", messages=[dict(role="user", content="go on and on")], max_tokens=1000,
                stream=True, ignore_eos=True)
    ids: list[str] = []
    for _ in range(3):
        with held_stream(stack, stack.url, key, body, text=True) as (chunk, walk_away):
            walk_away()
            wait_journaled(db_url, tenant, [chunk["id"]])  # the client has gone; vLLM is still paused
        ids.append(chunk["id"])
        record = _sql(db_url, "SELECT record FROM finished_requests WHERE request_id = %(r)s", r=chunk["id"])[0][0]
        if record["status"] != "completed":
            break
    return ids


def wait_journaled(db_url: str, tenant: str, request_ids: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while _sql(db_url, "SELECT count(*) FROM finished_requests WHERE request_id = ANY(%(s)s)",
               s=request_ids)[0][0] < len(request_ids):
        assert time.monotonic() < deadline, "requests not journaled"
        time.sleep(0.1)


# Independent of the code under test: the journal's figures and the ledger's, by subject.
JOURNAL_REQUESTS = """
  SELECT 'request:' || request_id, (record->>'prompt_tokens')::int, (record->>'completion_tokens')::int
    FROM finished_requests WHERE tenant = %(t)s
"""
JOURNAL_ITEMS = """
  SELECT stream,
         coalesce(((payload->>'body_json')::jsonb->'usage'->>'prompt_tokens')::int, 0),
         coalesce(((payload->>'body_json')::jsonb->'usage'->>'completion_tokens')::int, 0)
    FROM events WHERE type IN ('item_completed', 'item_failed') AND tenant = %(t)s
"""
LEDGER_SETTLES = """
  SELECT subject, input_tokens, output_tokens FROM ledger WHERE kind = 'settle' AND tenant = %(t)s
"""


def test_the_ledger_settles_exactly_what_the_journal_records(stack, db_url):
    tenant, key, client = tenant_client(stack, db_url, "ledger")
    ids = [client.chat.completions.create(model="ballast-tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=12, temperature=0).id]
    chunks = list(client.chat.completions.create(model="ballast-tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=9, stream=True, service_tier="flex"))
    ids.append(chunks[0].id)
    ids.append(client.completions.create(model="ballast-tiny", prompt="Once upon", max_tokens=7,
                                         extra_body=dict(service_tier="priority")).id)
    # Three choices: max_tokens reserved for each, every choice's tokens settled.
    three = client.chat.completions.create(model="ballast-tiny", messages=[{"role": "user", "content": "pick"}],
                                           max_tokens=5, temperature=0.9, seed=3, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    ids.append(three.id)
    ids += dropped_stream(stack, key, db_url, tenant)  # a stream the client walks away from
    two = dict(chat_line("q-two", "question two", 8), body=dict(chat_line("x", "question two", 8)["body"], n=2,
                                                                 temperature=1.0, top_k=1, ignore_eos=True))
    batch = submit(client, [chat_line(f"q{i}", f"question {i}", 6 + i) for i in range(6)]
                   + [dict(chat_line("too-long", "x", 10**6), custom_id="too-long"), two])  # fails on its own
    assert wait_for(client, batch.id).status == "completed"
    wait_journaled(db_url, tenant, ids)

    journal = {s: (i, o) for s, i, o in _sql(db_url, JOURNAL_REQUESTS + " UNION ALL " + JOURNAL_ITEMS, t=tenant)}
    settled = {s: (i, o) for s, i, o in _sql(db_url, LEDGER_SETTLES, t=tenant)}
    assert len(journal) == len(ids) + 8 and settled == journal
    assert journal[f"request:{three.id}"] == (three.usage.prompt_tokens, three.usage.completion_tokens)
    assert three.usage.completion_tokens > 5  # more than one choice's worth
    assert journal[f"item:{batch.id}:7"][1] == 16  # two choices of 8 each
    dropped = _sql(db_url, "SELECT record FROM finished_requests WHERE request_id = %(r)s", r=ids[-1])[0][0]
    # Cancelled, with what it had produced.
    assert (dropped["status"], dropped["completion_tokens"] >= 1) == ("cancelled", True), dropped
    assert settled[f"item:{batch.id}:6"] == (0, 0)
    # Every reservation is closed: requests refunded what they did not use, the batch all of its.
    assert _sql(db_url, "SELECT count(*) FROM open_reservations WHERE tenant = %(t)s", t=tenant)[0][0] == 0
    kinds = _sql(db_url, "SELECT kind FROM ledger WHERE subject = %(s)s ORDER BY position", s=f"batch:{batch.id}")
    assert [k for (k,) in kinds] == ["reserve", "refund"]
    reserved = _sql(db_url, "SELECT input_tokens, output_tokens FROM ledger WHERE kind = 'reserve' "
                            "AND subject = %(s)s", s=f"request:{ids[0]}")[0]
    assert reserved == (journal[f"request:{ids[0]}"][0], 12)  # corrected to the engine's prompt_tokens
    assert _sql(db_url, "SELECT output_tokens FROM ledger WHERE kind = 'reserve' AND subject = %(s)s",
                s=f"request:{three.id}")[0][0] == 15


def test_a_batch_over_the_enqueued_token_limit_fails_validation(stack, db_url):
    tenant, _, client = tenant_client(stack, db_url, "enqueued")
    _sql(db_url, "INSERT INTO limits (tenant, model, batch_queue_tokens) VALUES (%(t)s, '*', 1000) RETURNING 1",
         t=tenant)
    big = submit(client, [chat_line(f"q{i}", f"question {i}", 100) for i in range(10)])
    b = wait_for(client, big.id)
    assert b.status == "failed" and b.request_counts.total == 0
    [error] = b.errors.data
    assert error.code == "token_limit_exceeded" and error.line is None
    assert error.message == (f"Enqueued token limit reached for ballast-tiny in tenant {tenant}. Limit: 1,000 "
                             "enqueued tokens. Please try again once some in_progress batches have been completed.")
    small = submit(client, [chat_line("q", "question", 8)])
    assert wait_for(client, small.id).status == "completed"
    kinds = _sql(db_url, "SELECT subject, kind FROM ledger WHERE tenant = %(t)s AND subject NOT LIKE 'item:%%' "
                         "ORDER BY position", t=tenant)
    assert kinds == [(f"batch:{small.id}", "reserve"), (f"batch:{small.id}", "refund")]


def test_a_request_whose_api_process_dies_mid_stream_is_still_accounted_for(stack, db_url):
    """An API process SIGKILLed mid-stream reports nothing: the request is journaled and
    settled from the engine worker's record of what it served, once, and the reservation
    the dead process held is closed (settled and refunded, or expired first)."""
    from ballast import procs

    tenant, key, _ = tenant_client(stack, db_url, "killed")
    port = procs.free_port()
    doomed = stack.start(f"api-doomed-{port}", "api", env=dict(BALLAST_API_PORT=str(port)))
    url = f"http://127.0.0.1:{port}"
    procs.wait_until(lambda: _up(url), 60, "the second API process to be healthy", child=doomed)
    body = dict(model="ballast-tiny", messages=[dict(role="user", content="go on")], max_tokens=1000,
                stream=True, ignore_eos=True)
    with held_stream(stack, url, key, body, text=False) as (chunk, _):
        subject = f"request:{chunk['id']}"
        # Its reservation reaches the ledger within a flush tick; then the process dies,
        # the request mid-stream (vLLM paused, the client still reading).
        procs.wait_until(lambda: _kinds(db_url, subject) != [], 10, "the reserve row")
        assert _kinds(db_url, subject) == ["reserve"]
        doomed.proc.kill()
        doomed.proc.wait(10)
    rid = chunk["id"]
    finished = "SELECT record FROM finished_requests WHERE request_id = %(r)s"
    # The unreported delay (15 s here), a sweep, the holder TTL (30 s); on a loaded machine the
    # reconciler's ticks wait on the shared control worker (bench/RESULTS.md, admission).
    deadline = time.monotonic() + 180
    while not _sql(db_url, finished, r=rid):
        assert time.monotonic() < deadline, f"never accounted for: ledger {_kinds(db_url, subject)}"
        time.sleep(0.5)
    [(outcome,)] = _sql(db_url, finished, r=rid)
    [(record,)] = _sql(db_url, "SELECT record FROM served_requests WHERE request_id = %(r)s", r=rid)
    # The engine's own count, journaled when its stream ended (the API gone, it stopped).
    assert outcome["status"] == "abandoned" and outcome["completion_tokens"] == record["completion_tokens"]
    assert outcome["tenant"] == tenant and outcome["prompt_tokens"] == record["prompt_tokens"] > 0
    settles = _sql(db_url, "SELECT input_tokens, output_tokens FROM ledger WHERE subject = %(s)s AND kind = 'settle'",
                   s=subject)
    assert settles == [(record["prompt_tokens"], record["completion_tokens"])]
    # Closed by the settle, or expired first with its holder.
    assert _kinds(db_url, subject) in (["reserve", "settle"], ["reserve", "expire", "settle"])
    assert _sql(db_url, "SELECT count(*) FROM open_reservations WHERE tenant = %(t)s", t=tenant)[0][0] == 0


def test_requests_whose_api_process_dies_holding_their_window_are_still_accounted_for(stack, db_url):
    """Chats answered whole while their API process's window was still open (a minute
    here, the longest allowed): the process is SIGKILLed before it starts it. Each is
    journaled and settled once from its engine worker's record, for exactly the usage
    the client was told."""
    from openai import OpenAI

    from ballast import procs

    tenant, key, _ = tenant_client(stack, db_url, "window")
    port = procs.free_port()
    doomed = stack.start(f"api-window-{port}", "api", env=dict(BALLAST_API_PORT=str(port),
                                                               BALLAST_SETTLE_WINDOW_S="60"))
    url = f"http://127.0.0.1:{port}"
    procs.wait_until(lambda: _up(url), 60, "the second API process to be healthy", child=doomed)
    client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    told = {r.id: r.usage for r in (client.chat.completions.create(
        model="ballast-tiny", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4 + i,
        temperature=0) for i in range(3))}
    doomed.proc.kill()
    doomed.proc.wait(10)
    deadline = time.monotonic() + 180  # the unreported delay (15 s here), then a sweep
    while (_sql(db_url, "SELECT count(*) FROM finished_requests WHERE request_id = ANY(%(s)s)",
                s=list(told))[0][0] < len(told)):
        assert time.monotonic() < deadline, "never accounted for"
        time.sleep(0.5)
    for rid, usage in told.items():
        [(outcome,)] = _sql(db_url, "SELECT record FROM finished_requests WHERE request_id = %(r)s", r=rid)
        assert (outcome["status"], outcome["prompt_tokens"], outcome["completion_tokens"]) == (
            "abandoned", usage.prompt_tokens, usage.completion_tokens)  # no API reported it: the engine's record
        assert _sql(db_url, "SELECT input_tokens, output_tokens FROM ledger WHERE subject = %(s)s AND kind = 'settle'",
                    s=f"request:{rid}") == [(usage.prompt_tokens, usage.completion_tokens)]
    assert _sql(db_url, "SELECT count(*) FROM open_reservations WHERE tenant = %(t)s", t=tenant)[0][0] == 0


def _kinds(db_url: str, subject: str) -> list[str]:
    return [k for (k,) in _sql(db_url, "SELECT kind FROM ledger WHERE subject = %(s)s ORDER BY position", s=subject)]


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
