"""A batch job end to end: the official `openai` client → API → Temporal → vLLM → journal
→ output file, on real Postgres, a real Temporal dev server and real vLLM."""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid

import httpx
import pytest

from engine.sampling import Sampling
from protocol import keys
from tests.e2e.conftest import UPLOAD_LIMIT

pytestmark = pytest.mark.e2e

TOPICS = ["cats", "the sea", "ballast tanks", "a dragon", "Zürich", "1 + 1 =", "def f(x):", "привет", "haiku", "GPU"]


def chat_line(custom_id: str, content: str, max_tokens: int, **extra) -> dict:
    body = dict(model="ballast-tiny", messages=[dict(role="user", content=content)], max_tokens=max_tokens,
                temperature=0, **extra)
    return dict(custom_id=custom_id, method="POST", url="/v1/chat/completions", body=body)


def jsonl(lines) -> bytes:
    return "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines).encode()


def submit(client, lines, endpoint="/v1/chat/completions", window="24h", **kw):
    f = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window, **kw)


def wait_for(client, batch_id, statuses=("completed", "failed", "cancelled", "expired"), timeout=300, until=None):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses or (until and until(b)):
            return b
        assert time.monotonic() < deadline, f"batch stuck in {b.status}: {b}"
        time.sleep(0.3)


def read_jsonl(client, file_id) -> list[dict]:
    return [json.loads(ln) for ln in client.files.content(file_id).text.splitlines()]


async def greedy(engine, content: str, max_tokens: int, ignore_eos: bool = False) -> str:
    """vLLM's own greedy output for the prompt, computed here, independently of Ballast:
    the prompt rendered by the tokenizer's own chat template, the text by vLLM's own
    detokenizer as it streams (not Ballast's rendering or decoding)."""
    ids = engine.tokenizer.apply_chat_template([dict(role="user", content=content)], tokenize=True,
                                               add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    text: list[str] = []
    async for step in engine.generate(f"ref-{uuid.uuid4().hex}", ids,
                                      Sampling(max_tokens, temperature=0.0, ignore_eos=ignore_eos), detokenize=True):
        text.append(step.text)
    return "".join(text)


async def test_openai_client_runs_a_50_line_batch_to_vllms_greedy_output(client, engine, stack, temporal_address):
    prompts = [f"Request {i}: tell me about {TOPICS[i % len(TOPICS)]}" for i in range(50)]
    lines = [chat_line(f"item-{i}", p, 24 + (i % 5) * 8) for i, p in enumerate(prompts)]
    batch = await asyncio.to_thread(submit, client, lines, metadata={"purpose": "e2e"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"purpose": "e2e"}

    done = await asyncio.to_thread(wait_for, client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (50, 50, 0)
    assert done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = await asyncio.to_thread(read_jsonl, client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"item-{i}" for i in range(50)]  # input order

    expected = await asyncio.gather(*(greedy(engine, p, ln["body"]["max_tokens"])
                                      for p, ln in zip(prompts, lines, strict=True)))
    for o, want, ln in zip(out, expected, lines, strict=True):
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == "ballast-tiny"
        assert body["choices"][0]["message"]["content"] == want, o["custom_id"]
        assert body["usage"]["completion_tokens"] <= ln["body"]["max_tokens"]

    # Each run of the workflow is deterministic (its history replays against today's code)
    # and small: the stack continues as new every 16 items, so 50 items take 4 runs.
    from temporalio.client import Client
    from temporalio.worker import Replayer

    from workflows.batch import BatchWorkflow

    tc = await Client.connect(temporal_address)
    wid = f"batch:{batch.id}"
    for _ in range(50):
        runs = [w async for w in tc.list_workflows(f"WorkflowId = '{wid}'")]
        if len(runs) >= 4:
            break
        await asyncio.sleep(0.2)
    assert len(runs) == 4
    for run in runs:
        history = await tc.get_workflow_handle(wid, run_id=run.run_id).fetch_history()
        await Replayer(workflows=[BatchWorkflow]).replay_workflow(history)
        assert len(history.events) < 16 * 8  # no per-token events: a handful per item
        # Generations queue behind default-priority work and are shared between tenants by
        # weight: the stack's key is of tenant `default`, weight 1.
        generations = [e.activity_task_scheduled_event_attributes for e in history.events
                       if e.activity_task_scheduled_event_attributes.activity_type.name == "generate"]
        assert generations
        assert {(g.priority.priority_key, g.priority.fairness_key, g.priority.fairness_weight)
                for g in generations} == {(4, "default", 1.0)}


def test_lines_sharing_a_long_system_prompt_prefill_it_once_not_each(client):
    """Twelve lines that share a 5-block system prompt, run as one group: the first to
    reach the engine prefills it, the others wait for its first token (engine/
    prefix_leaders.py) and find it in vLLM's prefix cache. Judged by vLLM's own count of
    each line's cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`, its
    num_cached_tokens); run together without waiting, each would compute it (64 prompt
    tokens a step each), most finding nothing cached."""
    system = f"{uuid.uuid4().hex}: " + "You are a careful, terse assistant. " * 20  # fresh: nothing cached yet
    lines = [chat_line(f"s{i}", f"Question {i}?", 4) for i in range(12)]
    for line in lines:
        line["body"]["messages"].insert(0, dict(role="system", content=system))
    b = wait_for(client, submit(client, lines).id)
    assert b.status == "completed", b
    usage = [o["response"]["body"]["usage"] for o in read_jsonl(client, b.output_file_id)]
    shared_blocks = len(system) // 128  # vLLM CPU's 128-token blocks, one token a byte
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert sum(c >= shared_blocks * 128 for c in cached) >= len(lines) - 1, cached
    assert all(u["prompt_tokens"] > c for u, c in zip(usage, cached, strict=True))  # each its own question


def test_an_invalid_file_fails_validation_with_line_errors(client):
    lines = [
        chat_line("a", "fine", 8),
        '{"custom_id": "b", "method": "POST", "url": ',  # line 2: not JSON
        chat_line("c", "fine", 8),
        chat_line("a", "again", 8),  # line 4: duplicate custom_id
        dict(chat_line("d", "fine", 8), url="/v1/embeddings"),  # line 5: wrong url
    ]
    batch = submit(client, lines)
    done = wait_for(client, batch.id)
    assert done.status == "failed" and done.failed_at
    errors = {(e.line, e.code) for e in done.errors.data}
    assert errors == {(2, "invalid_json_line"), (4, "duplicate_custom_id"), (5, "mismatched_endpoint")}
    assert done.request_counts.total == 0  # nothing half-admitted


def test_requests_that_cannot_run_go_to_the_error_file_naming_their_line(client):
    lines = [
        chat_line("ok-1", "fine", 8),
        chat_line("too-long", "fine", 5000),  # beyond the 1024-token context
        dict(chat_line("no-model", "fine", 8), body=dict(chat_line("x", "y", 8)["body"], model="gpt-9")),
        chat_line("ok-2", "fine", 8),
        chat_line("prompt-too-long", "z" * 1100, 8),  # caught by the engine, after tokenizing
    ]
    done = wait_for(client, submit(client, lines).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 3)
    assert [o["custom_id"] for o in read_jsonl(client, done.output_file_id)] == ["ok-1", "ok-2"]
    errs = {e["custom_id"]: e["response"] for e in read_jsonl(client, done.error_file_id)}
    assert list(errs) == ["too-long", "no-model", "prompt-too-long"]
    assert errs["too-long"]["status_code"] == 400
    assert errs["too-long"]["body"]["error"]["code"] == "context_length_exceeded"
    assert errs["too-long"]["body"]["error"]["message"].startswith("Line 2:")
    # An unknown model is a 404, as OpenAI and vLLM answer it.
    assert errs["no-model"]["status_code"] == 404 and "Line 3:" in errs["no-model"]["body"]["error"]["message"]
    assert errs["prompt-too-long"]["body"]["error"]["message"].startswith("Line 5:")


def test_bad_lines_mixed_with_good_ones_sink_nothing(client):
    """20 good lines and 7 bad ones: every good line completes, every bad one gets its own
    400 naming its parameter and line, and the batch is not slowed into retries."""
    good = [chat_line(f"good-{i}", f"question {i}", 8) for i in range(20)]
    good.append(dict(chat_line("null-temperature", "q", 8),
                     body=dict(chat_line("x", "q", 8)["body"], temperature=None)))
    bad = {"top-p-2": ("top_p", 2), "stop-7": ("stop", 7), "hot": ("temperature", "hot"),
           "msgs-str": ("messages", "hi"), "n-2": ("n", 2), "top-logprobs": ("top_logprobs", 2)}
    lines = list(good)
    for cid, (param, value) in bad.items():
        lines.insert(3 * len(lines) // 4,
                     dict(chat_line(cid, "q", 8), body=dict(chat_line("x", "q", 8)["body"], **{param: value})))
    raw = jsonl(lines) + (b'{"custom_id": "surrogate", "method": "POST", "url": "/v1/chat/completions", "body": '
                          b'{"model": "ballast-tiny", "messages": [{"role": "user", "content": "\\ud800"}], '
                          b'"max_tokens": 8}}\n')
    f = client.files.create(file=("mixed.jsonl", raw), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (21, 7)
    assert {o["custom_id"] for o in read_jsonl(client, done.output_file_id)} == {ln["custom_id"] for ln in good}
    errs = {e["custom_id"]: e["response"] for e in read_jsonl(client, done.error_file_id)}
    for cid, (param, _) in bad.items():
        assert errs[cid]["status_code"] == 400 and errs[cid]["body"]["error"]["param"] == param, errs[cid]
    surrogate = errs["surrogate"]
    assert surrogate["status_code"] == 400 and surrogate["body"]["error"]["code"] == "unsupported_character"
    assert surrogate["body"]["error"]["message"].startswith(f"Line {len(lines) + 1}:")


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    return err


def test_bad_requests_get_4xx_in_openai_shape(stack):
    api = stack.http(timeout=30)
    _assert_openai_error(api.get("/v1/files/file-nope"), 404)
    _assert_openai_error(api.get("/v1/files/file-nope/content"), 404)
    _assert_openai_error(api.get("/v1/batches/batch_nope"), 404)
    _assert_openai_error(api.post("/v1/batches/batch_nope/cancel"), 404)
    one, empty = {"file": ("a.jsonl", b"{}\n")}, {"file": ("a.jsonl", b"")}
    _assert_openai_error(api.post("/v1/files", files=one, data={"purpose": "assistants"}), 400, "purpose")
    _assert_openai_error(api.post("/v1/files", files=one), 400, "purpose")
    _assert_openai_error(api.post("/v1/files", files=empty, data={"purpose": "batch"}), 400, "file")
    big = b"x" * (UPLOAD_LIMIT + 1)
    _assert_openai_error(api.post("/v1/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"}), 413)
    # Chunked, without Content-Length: caught while copying, and nothing is kept.
    _assert_openai_error(
        api.post("/v1/files", content=_chunked_multipart(big),
                 headers={"content-type": "multipart/form-data; boundary=XX"}), 413
    )
    fid = api.post("/v1/files", files={"file": ("a.jsonl", jsonl([chat_line("a", "x", 4)]))},
                   data={"purpose": "batch"}).json()["id"]
    ok = dict(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    _assert_openai_error(api.post("/v1/batches", json=dict(ok, endpoint="/v1/responses")), 400, "endpoint")
    # A window this deployment does not offer (it offers 1m, 1h, 24h): whether a short one
    # can be promised depends on the pace measured so far, tested on its own below.
    _assert_openai_error(api.post("/v1/batches", json=dict(ok, completion_window="2h")), 400, "completion_window")
    _assert_openai_error(api.post("/v1/batches", json=dict(ok, input_file_id="file-nope")), 404, "input_file_id")
    _assert_openai_error(api.post("/v1/batches", json={"endpoint": "/v1/completions"}), 400)
    _assert_openai_error(api.post("/v1/batches", content=b"{not json",
                                  headers={"content-type": "application/json"}), 400)
    _assert_openai_error(api.get("/v1/batches", params={"limit": 0}), 400, "limit")


def _chunked_multipart(payload: bytes):
    yield b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    yield b'--XX\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    for i in range(0, len(payload), 65536):
        yield payload[i : i + 65536]
    yield b"\r\n--XX--\r\n"


def test_list_batches_pages_newest_first(client):
    ids = [submit(client, [chat_line("a", "x", 2)]).id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    for i in ids:
        wait_for(client, i)


def test_cancel_mid_run_keeps_the_items_already_done(client, stack, gate, db_url):
    held_at = 40  # the short items finish below it; the long ones are held mid-run until cancelled
    gate.hold(held_at)
    # Prompts whose byte order is the lines' order: a page of items runs sorted by prompt.
    lines = [chat_line(f"short-{i}", f"brief {i}", 4) for i in range(4)]
    lines += [chat_line(f"long-{i}", f"long {i:02d}", 200, ignore_eos=True) for i in range(40)]
    batch = submit(client, lines)
    wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 4, timeout=120)
    # Every long item in flight is mid-run, a fact. (A workflow run has at most
    # BALLAST_BATCH_ITEMS_PER_RUN items in flight; the rest would start after continue-as-new.)
    in_flight = int(stack.env["BALLAST_BATCH_ITEMS_PER_RUN"])
    longs = {keys.item(batch.id, i): held_at for i in range(4, in_flight)}
    stack.wait_held(longs)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    out = read_jsonl(client, done.output_file_id)
    assert {o["custom_id"] for o in out} >= {f"short-{i}" for i in range(4)}
    errs = read_jsonl(client, done.error_file_id)
    assert errs and all(e["error"]["code"] == "batch_cancelled" for e in errs)
    assert len(out) + len(errs) == 44
    assert {e["custom_id"] for e in errs} == {f"long-{i}" for i in range(40)}
    # The cancelled generations flushed exactly what they had produced; the rest never ran.
    flushed = _sql(db_url, """SELECT stream, sum(jsonb_array_length(payload->'token_ids')) FROM events
                              WHERE type = 'item_chunk' AND stream LIKE %(s)s GROUP BY stream""",
                   s=f"item:{batch.id}:%")
    assert {s: n for s, n in flushed if s not in {keys.item(batch.id, i) for i in range(4)}} == longs
    with pytest.raises(Exception, match="Cannot cancel"):
        client.batches.cancel(batch.id)


def _sql(url: str, sql: str, **params):
    import psycopg

    from config.database import libpq_url

    with psycopg.connect(libpq_url(url)) as conn:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]


async def _generation_priorities(temporal_address: str, batch_id: str) -> set[int]:
    from temporalio.client import Client

    tc = await Client.connect(temporal_address)
    history = await tc.get_workflow_handle(f"batch:{batch_id}").fetch_history()  # 8 items: one run
    return {e.activity_task_scheduled_event_attributes.priority.priority_key for e in history.events
            if e.activity_task_scheduled_event_attributes.activity_type.name == "generate"}


def test_a_short_window_is_promised_on_the_engines_measured_pace_kept_and_refused_past_it(client, stack, db_url,
                                                                                          temporal_address):
    """The engine worker measures its batch pace while it runs a batch; a 1 h batch is then
    promised on it, runs ahead of the 24 h ones, and is kept; a 1 min batch past what that
    pace can do in a minute fails validation naming the window that could be promised."""
    # Long enough for the engine's once-a-second readings to find it busy more than once.
    lines = [chat_line(f"warm-{i}", f"Warm up {i}: {TOPICS[i % len(TOPICS)]}", 128, ignore_eos=True)
             for i in range(256)]
    assert wait_for(client, submit(client, lines).id).status == "completed"
    deadline = time.monotonic() + 30
    while not (paces := [r[0] for r in _sql(db_url, "SELECT (stats->>'batch_rate')::float FROM engines "
                                                    "WHERE seen_at > now() - interval '5 seconds'")]) or not max(paces):
        assert time.monotonic() < deadline, "no engine announced a batch pace after running a batch"
        time.sleep(0.5)
    pace = sum(paces)

    short = submit(client, [chat_line(f"s-{i}", f"Short {i}", 16) for i in range(8)], window="1h")
    done = wait_for(client, short.id)
    assert done.status == "completed" and done.completed_at <= done.expires_at == done.created_at + 3600
    promise = client.batches.retrieve(short.id).model_extra["ballast"]["promise"]
    assert promise["window"] == "1h" and 0 < promise["rate"] and promise["estimated_at"] <= done.expires_at
    assert _sql(db_url, "SELECT kept, completion_window FROM batch_promises WHERE batch_id = %(b)s",
                b=short.id) == [(True, "1h")]
    # Its generations went ahead of the 24 h batches' (4), at Temporal's default priority.
    assert asyncio.run(_generation_priorities(temporal_address, short.id)) == {3}

    # Twice what a minute of that pace can promise (its 0.8), at 1,000 output tokens a line.
    n = int(2 * pace * 0.8 * 60 / 1000) + 1
    assert n <= 1500, f"the engine's pace ({pace:.0f} tokens/s) is beyond what this test's file can overflow"
    over = submit(client, [chat_line(f"o-{i}", f"Over {i}", 1000) for i in range(n)], window="1m")
    refused = wait_for(client, over.id)
    assert refused.status == "failed" and refused.errors and refused.errors.data
    error = refused.errors.data[0]
    assert error.code == "completion_window_unattainable" and "promised now is 1h" in (error.message or ""), error
    assert _sql(db_url, "SELECT count(*) FROM batch_items WHERE batch_id = %(b)s", b=over.id) == [(0,)]
