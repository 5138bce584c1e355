"""The engine worker's endpoint serves only the API: a request without the engine token
(BALLAST_ENGINE_TOKEN), or with another, is answered 401 before its body is read; with it,
the endpoint streams as ever. In process, over a stand-in engine (no vLLM)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from engine.server import create_app
from engine.slots import EngineSlots
from engine.vllm_engine import Step

TOKEN = "engine-token-for-tests-0123456789abcdef"
JOB = dict(request_id="req-1", endpoint="/v1/completions", priority=0, tenant="acme", tier="default", weight=1,
           body=dict(model="ballast-tiny", prompt=[1, 2, 3], max_tokens=2))




class FakeEngine:
    """What the endpoint asks of an engine: its spec, its token bound, generation."""

    spec = SimpleNamespace(name="ballast-tiny", max_model_len=64)
    max_token_id = 255

    def __init__(self):
        self.generated: list[str] = []

    async def generate(self, request_id: str, prompt: list[int], sampling, **_):
        self.generated.append(request_id)
        yield Step([7], None, "a")
        yield Step([8], "length", "b")


def client(engine: FakeEngine, headers: dict[str, str] | None = None, served=None) -> httpx.AsyncClient:
    app = create_app(engine, EngineSlots(4), token=TOKEN, served=served)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine.test", headers=headers)


def lines(r: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines()]


@pytest.mark.parametrize("headers", [
    None,
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer "},
    {"X-Ballast-Engine-Token": TOKEN},
], ids=["none", "wrong", "longer", "shorter", "not-bearer", "empty", "other-header"])
@pytest.mark.parametrize("method, path", [("POST", "/v1/generate"), ("GET", "/stats")])
async def test_without_the_token_nothing_is_served(headers, method, path):
    engine = FakeEngine()
    async with client(engine, headers) as http:
        r = await http.request(method, path, json=JOB if method == "POST" else None)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["code"] == "invalid_engine_token" and "BALLAST_ENGINE_TOKEN" in error["message"]
    assert TOKEN not in r.text
    assert engine.generated == []


async def test_with_the_token_it_streams():
    engine = FakeEngine()
    async with client(engine, {"Authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.post("/v1/generate", json=JOB)
        stats = await http.get("/stats")
    assert r.status_code == 200, r.text
    got = lines(r)
    assert got[0] == {"prompt_tokens": 3}
    assert [x.get("text") for x in got[1:3]] == ["a", "b"]
    assert got[-1]["finish_reason"] == "length" and got[-1]["completion_tokens"] == 2
    assert engine.generated == ["req-1"]
    assert stats.status_code == 200 and "acme" in stats.json()["fairness"]["counters"]


async def test_every_stream_that_ends_is_recorded_as_served_with_the_engines_counts():
    served: list[dict] = []
    async with client(FakeEngine(), {"Authorization": f"Bearer {TOKEN}"}, served.append) as http:
        r = await http.post("/v1/generate", json=JOB)
        await http.post("/v1/generate", json=dict(JOB, body=dict(JOB["body"], max_tokens=10**6)))  # refused: 4xx
    assert r.status_code == 200
    assert served == [dict(request_id="req-1", tenant="acme", tier="default", model="ballast-tiny",
                           endpoint="/v1/completions", prompt_tokens=3, completion_tokens=2, finish_reason="length",
                           http_request_id=None)]


async def test_the_clients_request_id_is_in_the_engines_record_and_log(caplog):
    served: list[dict] = []
    caplog.set_level(logging.INFO, logger="engine.server")
    async with client(FakeEngine(), {"Authorization": f"Bearer {TOKEN}"}, served.append) as http:
        r = await http.post("/v1/generate", json=dict(JOB, http_request_id="client-7"))
    assert r.status_code == 200
    assert served[0]["http_request_id"] == "client-7"
    assert [m for m in caplog.messages if "req-1" in m and "x-request-id client-7" in m], caplog.messages


async def test_refused_before_the_body_is_read():
    app = create_app(FakeEngine(), EngineSlots(4), token=TOKEN)
    sent: list[dict] = []

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    scope = dict(type="http", asgi=dict(version="3.0"), http_version="1.1", method="POST", scheme="http",
                 path="/v1/generate", raw_path=b"/v1/generate", root_path="", query_string=b"",
                 headers=[(b"host", b"engine.test"), (b"content-type", b"application/json"),
                          (b"authorization", b"Bearer wrong")],
                 client=("127.0.0.1", 1), server=("engine.test", 80))
    await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401


def test_an_empty_token_is_refused():
    with pytest.raises(ValueError, match="BALLAST_ENGINE_TOKEN"):
        create_app(FakeEngine(), EngineSlots(4), token="")


async def test_the_probes_ask_no_token_and_say_what_is_down():
    """/healthz and /readyz are the one open door (an orchestrator's probe holds no secret):
    they answer without the token, name no tenant and no work, and /readyz is 503 naming
    the part that is down: vLLM's engine dead, or the worker not polling its task queues."""

    class Dying(FakeEngine):
        dead = False

        async def check_health(self):
            if self.dead:
                raise RuntimeError("EngineDeadError")

    engine, polling = Dying(), [True]
    app = create_app(engine, EngineSlots(4), token=TOKEN, polling=lambda: polling[0])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine.test") as http:
        assert (await http.get("/healthz")).json() == dict(status="ok")
        r = await http.get("/readyz")
        assert r.status_code == 200 and r.json() == dict(status="ok", parts=dict(vllm="ok", workers="ok"))
        polling[0] = False  # drained, or not yet polling
        r = await http.get("/readyz")
        assert r.status_code == 503 and r.json()["parts"] == dict(vllm="ok", workers="down: not polling")
        engine.dead = True
        assert (await http.get("/readyz")).json()["parts"]["vllm"] == "down: RuntimeError"
        assert (await http.get("/stats")).status_code == 401  # the rest still asks for the token
