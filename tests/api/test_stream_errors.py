"""A failure on the engine's side reaches the client in OpenAI's shape, never as a cut
connection: mid-stream as an error event then `data: [DONE]`, before the first token as a
502 (or the engine's own 4xx, passed through).

In process: the app with one fake engine worker, an `httpx.MockTransport` that answers
POST /v1/generate with scripted NDJSON (engine/server.py's protocol), and a fake Temporal
that records the requests' windows (each request with its outcome, once it has ended).
Postgres must not be reached on this path.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from api import interactive
from api.app import create_app
from api.deps import Services
from config import Settings
from journal.tenant_store import Principal
from policy.placement import EngineView
from storage.objects import ObjectStore
from tests.api.conftest import BARE_KEY, Untouchable, Workflows, assert_openai_error, known_keys

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BODIES = {
    CHAT: dict(model="ballast-tiny", messages=[dict(role="user", content="hi")], max_tokens=4),
    COMPLETIONS: dict(model="ballast-tiny", prompt="hi", max_tokens=4),
}
ACCEPTED = {"prompt_tokens": 3}
TOKEN = {"text": "a", "tokens": 1}
FINISH = {"finish_reason": "length", "completion_tokens": 1}
# What engine/server.py sends when generation fails after it was admitted.
FAILED: dict[str, Any] = {
    "error": {"message": "The engine failed while generating: RuntimeError.", "type": "server_error", "param": None,
              "code": "engine_error"},
    "status": 500,
}
BROKEN = httpx.RemoteProtocolError("peer closed connection without sending complete message body")


class OneEngine:
    """The engine directory: one live engine serving the model."""

    async def live(self):
        return [EngineView("engine-1", "http://engine.test", "ballast-tiny", 0, 0, 4)]


def engine(*lines: dict, then: Exception | None = None) -> httpx.MockTransport:
    """An engine worker that streams `lines` as NDJSON, then breaks with `then` or just ends."""

    async def stream():
        for line in lines:
            yield (json.dumps(line) + "\n").encode()
            await asyncio.sleep(0)
        if then is not None:
            raise then

    def generate(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/v1/generate")
        return httpx.Response(200, content=stream(), headers={"content-type": "application/x-ndjson"})

    return httpx.MockTransport(generate)


@pytest.fixture
def workflows():
    return Workflows()


@pytest.fixture
def serve(settings, workflows):
    """`serve(engine)`: a client of the app (use it in `async with`), whose one engine worker is `engine`."""

    def make(transport: httpx.MockTransport, over: Settings | None = None) -> httpx.AsyncClient:
        app = create_app(over or settings, temporal=workflows)
        db: Any = Untouchable("postgres")
        engines: Any = OneEngine()  # stands in for the EngineDirectory
        app.state.services = Services(over or settings, db, workflows, ObjectStore(settings.object_store_url), engines,
                                      httpx.AsyncClient(transport=transport),
                                      keys=known_keys({BARE_KEY: Principal("default", "key_bare")}))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ballast.test",
                                   headers={"Authorization": f"Bearer {BARE_KEY}"})
        client.services = app.state.services  # type: ignore[attr-defined]
        return client

    return make


async def settled(api: httpx.AsyncClient) -> None:
    """The requests that have ended, handed to Temporal now rather than at the window's end."""
    await api.services.settlement.flush()  # type: ignore[attr-defined]


def events(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    out = []
    for block in r.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error_event(event: dict, message: str) -> None:
    assert set(event) == {"error"}, event
    assert event["error"] == dict(message=message, type="server_error", param=None, code="engine_error"), event


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("lines, then, message", [
    ((ACCEPTED, TOKEN, FAILED), None, FAILED["error"]["message"]),
    ((ACCEPTED, TOKEN), BROKEN, "The engine worker's stream broke (RemoteProtocolError)."),
    ((ACCEPTED, TOKEN), None, "The engine worker ended the stream early."),
], ids=["error-line", "connection-cut", "early-end"])
async def test_a_stream_that_fails_midway_ends_with_an_error_event(serve, workflows, endpoint, lines, then, message):
    async with serve(engine(*lines, then=then)) as api:
        r = await api.post(endpoint, json=dict(BODIES[endpoint], stream=True))
    got = events(r)
    *chunks, error, done = got
    # What was generated reached the client, then the error, then the end: no finish, no usage.
    text = [c["choices"][0] for c in chunks]
    assert "".join(c.get("text") or c.get("delta", {}).get("content", "") for c in text) == "a", got
    assert all(c["finish_reason"] is None for c in text), got
    assert_error_event(error, message)
    assert done == "[DONE]"
    await settled(api)
    assert len(workflows.started) == 1 and [o.status for o in workflows.outcomes] == ["failed"]


@pytest.mark.parametrize("lines, then, message", [
    ((ACCEPTED, TOKEN, FAILED), None, FAILED["error"]["message"]),
    ((ACCEPTED, TOKEN), BROKEN, "The engine worker's stream broke (RemoteProtocolError)."),
    ((ACCEPTED,), None, "The engine worker ended the stream early."),
], ids=["error-line", "connection-cut", "early-end"])
async def test_a_failure_before_the_answer_is_whole_is_a_502(serve, workflows, lines, then, message):
    async with serve(engine(*lines, then=then)) as api:
        r = await api.post(CHAT, json=BODIES[CHAT])
    err = assert_openai_error(r, 502, code="engine_error")
    assert (err["message"], err["type"]) == (message, "server_error")
    await settled(api)
    assert [o.status for o in workflows.outcomes] == ["failed"]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_engines_refusal_is_passed_through(serve, workflows, stream):
    refusal = {"error": {"message": "This model's maximum context length is 1024 tokens.",
                         "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"},
               "status": 400}
    async with serve(engine(refusal)) as api:
        r = await api.post(CHAT, json=dict(BODIES[CHAT], stream=stream))
    err = assert_openai_error(r, 400, param="messages", code="context_length_exceeded")
    assert err["message"] == refusal["error"]["message"]
    await settled(api)
    assert workflows.started == []  # never admitted: no request workflow


async def test_a_whole_stream_ends_with_finish_and_done(serve, workflows):
    """The fake engine speaks the protocol: without a failure, the stream ends as usual."""
    async with serve(engine(ACCEPTED, TOKEN, FINISH)) as api:
        r = await api.post(CHAT, json=dict(BODIES[CHAT], stream=True, stream_options={"include_usage": True}))
    *_, finish, usage, done = events(r)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["usage"] == dict(prompt_tokens=3, completion_tokens=1, total_tokens=4)
    assert done == "[DONE]"
    await settled(api)
    assert [o.status for o in workflows.outcomes] == ["completed"]


ENGINE_TOKEN = "the-engine-token-of-this-deployment"


def guarded(expected: str) -> httpx.MockTransport:
    """An engine worker whose endpoint demands `expected` as its engine token (engine/server.py)."""
    streams = engine(ACCEPTED, TOKEN, FINISH)

    async def generate(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != f"Bearer {expected}":
            refused = {"message": "Invalid engine token.", "type": "invalid_request_error", "param": None,
                       "code": "invalid_engine_token"}
            return httpx.Response(401, json={"error": refused})
        return await streams.handle_async_request(request)

    return httpx.MockTransport(generate)


async def test_the_api_presents_the_engine_token(serve, settings, workflows):
    over = settings.model_copy(update=dict(engine_token=SecretStr(ENGINE_TOKEN)))
    async with serve(guarded(ENGINE_TOKEN), over) as api:
        r = await api.post(CHAT, json=BODIES[CHAT])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    await settled(api)


@pytest.mark.parametrize("token", [None, "another-deployments-token"], ids=["unset", "different"])
async def test_an_engine_refusing_the_token_is_a_502_and_logged(serve, settings, workflows, caplog, token):
    over = settings.model_copy(update=dict(engine_token=SecretStr(token) if token else None))
    async with serve(guarded(ENGINE_TOKEN), over) as api:
        r = await api.post(CHAT, json=BODIES[CHAT])
    assert_openai_error(r, 502, code="engine_error")
    assert ENGINE_TOKEN not in r.text
    assert any("BALLAST_ENGINE_TOKEN" in rec.getMessage() and rec.levelname == "ERROR" for rec in caplog.records)
    await settled(api)
    assert workflows.started == []


@pytest.mark.parametrize("content, off_loop", [("hi", False), ("x" * (interactive.INLINE_PROMPT_CHARS + 1), True)])
async def test_a_long_prompt_is_tokenized_off_the_event_loop(serve, settings, monkeypatch, content, off_loop):
    import threading

    from api.services.placer import Placer

    where: list[int] = []
    real = Placer.prompt

    def prompt(self, req, pool=None):
        where.append(threading.get_ident())
        return real(self, req, pool)

    monkeypatch.setattr(Placer, "prompt", prompt)
    roomy = settings.model_copy(update=dict(max_request_bytes=1 << 20))
    async with serve(engine(ACCEPTED, TOKEN, FINISH), roomy) as api:
        r = await api.post(CHAT, json=dict(BODIES[CHAT], messages=[dict(role="user", content=content)]))
    assert r.status_code == 200, r.text
    assert len(where) == 1 and (where[0] != threading.get_ident()) == off_loop
    await settled(api)
