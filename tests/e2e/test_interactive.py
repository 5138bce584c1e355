"""Interactive requests end to end, and batch work yielding to them, on the real stack."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from config.api import ApiSettings
from tests.e2e.conftest import WAIT_S, make_key
from tests.e2e.test_batch import _sql, chat_line, greedy, read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e


async def test_chat_completion_is_vllms_greedy_output_with_tier_and_usage(client, engine, db_url):
    r = await asyncio.to_thread(
        client.chat.completions.create, model="ballast-tiny", messages=[{"role": "user", "content": "hello there"}],
        max_tokens=20, temperature=0, service_tier="priority")
    want = await greedy(engine, "hello there", 20)
    assert r.choices[0].message.content == want
    assert r.service_tier == "priority" and r.model == "ballast-tiny" and r.object == "chat.completion"
    assert r.usage.completion_tokens <= 20 and r.usage.prompt_tokens > 0
    # The request is journaled by its workflow, off the token path.
    deadline = time.monotonic() + 30
    while not (rows := _sql(db_url, "SELECT record FROM finished_requests WHERE request_id = %(r)s", r=r.id)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert rows[0][0]["status"] == "completed" and rows[0][0]["completion_tokens"] == r.usage.completion_tokens
    assert rows[0][0]["tier"] == "priority"


async def test_priority_is_granted_not_taken(stack, db_url):
    """A tenant not granted `priority` that asks for it runs at `default`, as its response
    and the journal say; granted (as the stack's own tenant is), it runs at `priority`."""
    from openai import OpenAI

    key = await asyncio.to_thread(make_key, db_url, "ungranted-" + uuid.uuid4().hex[:6], ())
    ungranted = OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
    r = await asyncio.to_thread(
        ungranted.chat.completions.create, model="ballast-tiny", messages=[{"role": "user", "content": "me first"}],
        max_tokens=2, service_tier="priority")
    assert r.service_tier == "default"
    deadline = time.monotonic() + 30
    while not (rows := _sql(db_url, "SELECT record FROM finished_requests WHERE request_id = %(r)s", r=r.id)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert rows[0][0]["tier"] == "default"


def test_the_engine_worker_serves_only_the_api(stack):
    """Its port is no way around keys, quotas and the journal: without the stack's engine
    token (BALLAST_ENGINE_TOKEN), or with another, it answers 401; the API, which has it,
    is served (the tests around this one)."""
    job = dict(request_id="direct-to-the-engine", endpoint="/v1/completions", priority=0, tenant="nobody",
               body=dict(model="ballast-tiny", prompt="hi", max_tokens=2))
    for headers in ({}, {"Authorization": "Bearer not-the-engine-token"}):
        r = httpx.post(stack.engine_url + "/v1/generate", json=job, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_engine_token", r.text
        assert httpx.get(stack.engine_url + "/stats", headers=headers, timeout=10).status_code == 401
    assert "fairness" in stack.stats()  # with the token


async def test_streamed_chat_and_completions(client, engine):
    def stream():
        return list(client.chat.completions.create(
            model="ballast-tiny", messages=[{"role": "user", "content": "stream me"}], max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True}))

    chunks = await asyncio.to_thread(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == await greedy(engine, "stream me", 24)
    assert chunks[-1].usage.completion_tokens <= 24 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert all(c.service_tier == "default" for c in chunks)

    done = await asyncio.to_thread(client.completions.create, model="ballast-tiny", prompt="Once upon", max_tokens=10,
                                   temperature=0)
    parts = await asyncio.to_thread(lambda: list(client.completions.create(
        model="ballast-tiny", prompt="Once upon", max_tokens=10, temperature=0, stream=True)))
    assert "".join(p.choices[0].text for p in parts) == done.choices[0].text
    assert done.object == "text_completion" and done.usage.completion_tokens <= 10


async def _requests_settled(stack, temporal_address: str, db_url: str) -> int:
    """Once the API's open window has gone and no window workflow of this stack is still
    running (an earlier test's requests may journal late): how many requests are
    journaled. Only this stack's task queue: the Temporal server is shared with stacks of
    other modules, whose workflows outlive them."""
    from temporalio.client import Client

    await asyncio.sleep(ApiSettings.model_fields["settle_window_s"].default + 0.5)
    tc = await Client.connect(temporal_address)
    running = ("WorkflowType = 'RequestWindow' AND ExecutionStatus = 'Running' "
               f"AND TaskQueue = '{stack.env['BALLAST_INTERACTIVE_QUEUE']}'")
    deadline = time.monotonic() + 60
    while (await tc.count_workflows(running)).count:
        assert time.monotonic() < deadline, "request workflows still running"
        await asyncio.sleep(0.1)
    return _sql(db_url, "SELECT count(*) FROM finished_requests")[0][0]


async def test_bad_interactive_requests_get_4xx_and_admit_nothing(stack, db_url, temporal_address):
    api = stack.http(timeout=30)
    before = await _requests_settled(stack, temporal_address, db_url)
    msgs = [{"role": "user", "content": "hi"}]
    chat = dict(model="ballast-tiny", messages=msgs)
    cases = [
        ("chat", dict(model="ballast-tiny", messages=[{"role": "user", "content": "x" * 1100}]), 400,
         "messages"),  # > context
        ("chat", dict(chat, max_tokens=0), 400, "max_tokens"),
        ("chat", dict(chat, model="gpt-9"), 404, "model"),
        ("chat", dict(model="ballast-tiny", messages=[{"content": "no role"}]), 400, "messages[0].role"),
        ("chat", dict(model="ballast-tiny", messages="hi"), 400, "messages"),
        ("chat", dict(chat, service_tier="platinum"), 400, "service_tier"),
        ("chat", dict(chat, top_p=1.5), 400, "top_p"),
        ("chat", dict(chat, top_logprobs=3), 400, "top_logprobs"),  # without logprobs: true
        ("chat", dict(chat, stream=True, stream_options="yes"), 400, "stream_options"),
        ("chat", dict(chat, stream=False, stream_options={"include_usage": True}), 400, "stream_options"),
        ("chat", dict(chat, messages=[{"role": "user", "content": "nul\u0000"}]), 400, "messages[0].content"),
        ("chat", dict(chat, frobnicate=1), 400, "frobnicate"),
        ("completions", dict(model="ballast-tiny", prompt=[1, 2, 10**6]), 400, "prompt"),  # beyond the vocabulary
    ]
    for endpoint, body, status, param in cases:
        r = api.post(f"/v1/{endpoint.replace('chat', 'chat/completions')}", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (body, err)
    r = api.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    # A lone surrogate, as JSON allows it: refused where it is, not a cut connection.
    r = api.post("/v1/chat/completions",
                 content=b'{"model": "ballast-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                 headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages[0].content"), r.text
    assert await _requests_settled(stack, temporal_address, db_url) == before


def test_nulls_mean_defaults_as_in_openais_api(stack):
    api = stack.http(timeout=60)
    body = dict(model="ballast-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=None,
                top_p=None, stop=None, seed=None, n=None)
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_the_openai_client_sees_the_error(client):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="ballast-tiny", prompt="y" * 1100, max_tokens=5)


class Surges:
    """Bursts of interactive requests at random moments, from a thread of their own, until
    stopped: the batch under test must yield to each one."""

    def __init__(self, stack, gaps=(0.15, 0.5), burst: int = 2, seed: int = 3, max_tokens: int = 4):
        self.stack, self.gaps, self.burst, self.rng = stack, gaps, burst, random.Random(seed)
        self.max_tokens = max_tokens
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        body = dict(model="ballast-tiny", messages=[{"role": "user", "content": "surge"}], max_tokens=self.max_tokens,
                    temperature=0)
        with self.stack.http(timeout=60) as http, ThreadPoolExecutor(self.burst) as pool:
            while not self._stop.wait(self.rng.uniform(*self.gaps)):
                rs = list(pool.map(lambda _: http.post("/v1/chat/completions", json=body), range(self.burst)))
                self.statuses += [r.status_code for r in rs]


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelling", "finalizing"])
async def test_a_surge_while_a_batch_ends_leaves_it_consistent(client, stack, gate, db_url, cancel):
    """Surges come and go while the batch ends. The gate holds every item short of its end
    until a surge has preempted some of them, so the ending (a cancel, or the last tokens
    and finalizing) overlaps preemptions, however fast the engine runs."""
    gate.hold(30)
    lines = [chat_line(f"e-{i}", f"ending {i}", 200 if cancel else 40, ignore_eos=True) for i in range(20)]
    batch = await asyncio.to_thread(submit, client, lines)
    preempted = "SELECT count(*) FROM events WHERE type = 'item_preempted' AND stream LIKE %(s)s"
    with Surges(stack, gaps=(0.3, 0.9), burst=3) as surges:  # calm spells let batch back in
        deadline = time.monotonic() + WAIT_S
        while _sql(db_url, preempted, s=f"item:{batch.id}:%")[0][0] == 0:
            assert time.monotonic() < deadline, "no preemption"
            await asyncio.sleep(0.05)
        if cancel:  # every item is held short of its end: the cancel lands mid-run
            await asyncio.to_thread(client.batches.cancel, batch.id)
        else:  # on to the end and finalizing, the surges going on
            gate.release()
        done = await asyncio.to_thread(wait_for, client, batch.id)
    assert set(surges.statuses) == {200}
    assert done.status == ("cancelled" if cancel else "completed"), done
    out = await asyncio.to_thread(read_jsonl, client, done.output_file_id) if done.output_file_id else []
    errs = await asyncio.to_thread(read_jsonl, client, done.error_file_id) if done.error_file_id else []
    ids = [o["custom_id"] for o in out] + [e["custom_id"] for e in errs]
    assert sorted(ids) == sorted(f"e-{i}" for i in range(20))  # every item exactly once
    like = f"item:{batch.id}:%"
    assert _sql(db_url, """SELECT stream FROM events
                           WHERE stream LIKE %(s)s AND type IN ('item_completed', 'item_failed')
                           GROUP BY stream HAVING count(*) > 1""", s=like) == []
    assert _sql(db_url, """SELECT stream, payload->>'offset' FROM events WHERE stream LIKE %(s)s AND type = 'item_chunk'
                           GROUP BY 1, 2 HAVING count(*) > 1""", s=like) == []
    if cancel:
        assert out == []  # held short of their ends until the cancel: none finished
    else:
        assert len(out) == 20
