"""The engine worker's endpoint serves only the API: a request without the engine token
(BALLAST_ENGINE_TOKEN), or with another, is answered 401 before its body is read; with it,
the endpoint streams as ever. In process, over a stand-in engine (no vLLM)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from engine.fair_share import FairShare
from engine.model_spec import ModelSpec
from engine.server import create_app
from engine.slots import EngineSlots
from engine.vllm_engine import Step

TOKEN = "engine-token-for-tests-0123456789abcdef"
JOB = dict(request_id="req-1", endpoint="/v1/completions", priority=0, tenant="acme", tier="default", weight=1,
           body=dict(model="ballast-tiny", prompt=[1, 2, 3], max_tokens=2))




class FakeEngine:
    """What the endpoint asks of an engine: its spec, its token bound, generation."""

    spec = ModelSpec("unused", "ballast-tiny", 64)
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


class Choices(FakeEngine):
    """Each choice's request: its seed, and whether it ran to its end; `-1` fails after a token."""

    def __init__(self):
        super().__init__()
        self.seeds: dict[str, int | None] = {}
        self.ended: set[str] = set()
        self.failing = False

    async def generate(self, request_id: str, prompt: list[int], sampling, **_):
        self.seeds[request_id] = sampling.seed
        yield Step([7], None, "a")
        if request_id.endswith("-1") and self.failing:
            raise RuntimeError("choice 1 broke")
        await asyncio.sleep(0.05 if self.failing else 0)
        yield Step([8], "length", "b")
        self.ended.add(request_id)


async def test_each_choice_is_a_generation_seeded_as_vllms_children_and_all_end_together():
    engine, served = Choices(), []
    body = dict(JOB["body"], n=3, seed=40, temperature=0.5)
    async with client(engine, {"Authorization": f"Bearer {TOKEN}"}, served.append) as http:
        r = await http.post("/v1/generate", json=dict(JOB, body=body))
        engine.failing = True
        broken = await http.post("/v1/generate", json=dict(JOB, request_id="req-2", body=body))
    got = lines(r)
    assert engine.seeds == {"req-1-0": 40, "req-1-1": 41, "req-1-2": 42, "req-2-0": 40, "req-2-1": 41, "req-2-2": 42}
    assert sorted((x.get("choice", 0), x["text"]) for x in got if "text" in x) == [
        (c, t) for c in range(3) for t in "ab"]
    assert got[-1]["completion_tokens"] == 6 and [c["completion_tokens"] for c in got[-1]["choices"]] == [2, 2, 2]
    assert served[0]["completion_tokens"] == 6 and served[0]["finish_reason"] == "length"
    # One choice failing fails the request and stops the others (none ran to its end).
    assert lines(broken)[-1]["error"]["code"] == "engine_error"
    assert not {f"req-2-{i}" for i in range(3)} & engine.ended
    assert served[1]["finish_reason"] is None


class Echoing(Choices):
    """As Choices, giving prompt logprobs to whichever request asks for them."""

    tokenizer = SimpleNamespace(decode=lambda ids: "the prompt")

    def __init__(self):
        super().__init__()
        self.asked: dict[str, bool] = {}  # by request: whether it asked for prompt logprobs

    async def generate(self, request_id: str, prompt: list[int], sampling, **kw):
        first = self.asked[request_id] = sampling.prompt_logprobs is not None
        async for step in super().generate(request_id, prompt, sampling, **kw):
            yield Step(step.token_ids, step.finish_reason, step.text,
                       prompt_logprobs=[[["p", None]]] * len(prompt) if first else None)
            first = False


async def test_an_echo_of_several_choices_takes_the_prompt_logprobs_once():
    engine = Echoing()
    body = dict(JOB["body"], n=3, temperature=0.5, echo=True, logprobs=1)
    async with client(engine, {"Authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.post("/v1/generate", json=dict(JOB, body=body))
    echoes = [x for x in lines(r) if x.get("text") == "the prompt"]
    assert sorted(x.get("choice", 0) for x in echoes) == [0, 1, 2]
    assert all(x["logprobs"] == [[["p", None]]] * 3 for x in echoes)
    # The prompt's logprobs in one request of their own, then the choices without them.
    assert engine.asked == {"req-1-echo": True, "req-1-0": False, "req-1-1": False, "req-1-2": False}


class FakeEmbedder:
    """An engine of an embedding model: its tokenizer (a byte per character), its vectors."""

    spec = ModelSpec("unused", "emb", 16, task="embed")
    max_token_id = 255
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=True: [1] * add_special_tokens + [
        ord(c) for c in text])

    def __init__(self):
        self.embedded: list[tuple[str, list[list[int]], int | None]] = []

    async def embed(self, request_id: str, inputs: list[list[int]], *, dimensions=None, **_):
        self.embedded.append((request_id, inputs, dimensions))
        if dimensions is not None:
            raise ValueError("Model 'emb' does not support Matryoshka embeddings")
        return [[float(len(ids)), 0.5] for ids in inputs]


EMBED = dict(JOB, endpoint="/v1/embeddings", body=dict(model="emb", input=["ab", "c"]))


async def test_an_embedding_engine_answers_every_vector_at_once_and_records_the_prompt_tokens():
    served: list[dict] = []
    engine = FakeEmbedder()
    async with client(engine, {"Authorization": f"Bearer {TOKEN}"}, served.append) as http:
        r = await http.post("/v1/generate", json=EMBED)
        bare = await http.post("/v1/generate", json=dict(EMBED, body=dict(model="emb", input=[5, 6],
                                                                            add_special_tokens=False)))
    got = lines(r)
    assert got[0] == {"prompt_tokens": 5} and got[-1]["embeddings"] == [[3.0, 0.5], [2.0, 0.5]], got
    assert got[-1]["completion_tokens"] == 0 and len(got) == 2
    assert engine.embedded[0] == ("req-1", [[1, 97, 98], [1, 99]], None)
    assert lines(bare)[-1]["embeddings"] == [[2.0, 0.5]] and engine.embedded[1][1] == [[5, 6]]  # ids as given
    assert served[0] == dict(request_id="req-1", tenant="acme", tier="default", model="emb",
                             endpoint="/v1/embeddings", prompt_tokens=5, completion_tokens=0, finish_reason="stop",
                             http_request_id=None)


@pytest.mark.parametrize("engine, job, param, says", [
    (FakeEmbedder(), JOB | dict(body=dict(model="emb", prompt=[1, 2], max_tokens=2)), "model", "is an embedding model"),
    (FakeEngine(), dict(EMBED, body=dict(model="ballast-tiny", input="x")), "model", "serves no embeddings"),
    (FakeEmbedder(), dict(EMBED, body=dict(model="emb", input="x" * 20)), "input", "maximum context length"),
    (FakeEmbedder(), dict(EMBED, body=dict(model="emb", input=[300])), "input", "out of vocabulary"),
    (FakeEmbedder(), dict(EMBED, body=dict(model="emb", input="x", dimensions=4)), "dimensions", "Matryoshka"),
], ids=["chat-to-embedder", "embeddings-to-generator", "too-long", "vocabulary", "dimensions"])
async def test_what_an_engine_cannot_embed_is_a_400_naming_why(engine, job, param, says):
    async with client(engine, {"Authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.post("/v1/generate", json=job)
    (failed,) = [ln for ln in lines(r) if "error" in ln]
    assert failed["status"] == 400 and failed["error"]["param"] == param and says in failed["error"]["message"], r.text


async def test_a_request_that_would_wait_past_its_tiers_bound_is_refused_before_it_is_accepted():
    # One slot, held, 3 default requests waiting for it, each slot held 10 s: a default
    # request's wait is 40 s, past its 15 s bound; a priority one's is 10 s, inside its 30 s.
    fair = FairShare("vtc", 1, bounds=dict(priority=30, default=15))
    fair.holds.extend([10.0] * 8)
    hold = asyncio.Event()

    async def occupy():
        async with fair.turn("other", "default", 1, 3, 1):
            await hold.wait()

    held = [asyncio.create_task(occupy()) for _ in range(4)]
    await asyncio.sleep(0)
    engine, served = FakeEngine(), []
    app = create_app(engine, EngineSlots(1), fair, token=TOKEN, served=served.append)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine.test",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        bad = await http.post("/v1/generate", json=dict(JOB, body=dict(JOB["body"], max_tokens=10**6)))
        r = await http.post("/v1/generate", json=JOB)
    assert lines(bad)[0]["status"] == 400  # a bad request is told so first, whatever the queue
    [refusal] = lines(r)
    assert refusal["status"] == 429 and refusal["retry_after_s"] == 25
    assert refusal["error"]["code"] == "resource_unavailable" and refusal["error"]["type"] == "rate_limit_error"
    assert engine.generated == [] and served == [] and fair.waiting == 3
    assert fair.over_bound("acme", "priority") is None
    hold.set()
    await asyncio.gather(*held)


async def test_a_request_that_waits_its_tiers_bound_without_a_slot_is_refused_then_never_accepted():
    fair = FairShare("vtc", 1, bounds=dict(default=0.05))  # too few holds measured to refuse at arrival
    hold = asyncio.Event()

    async def occupy():
        async with fair.turn("other", "default", 1, 3, 1):
            await hold.wait()

    held = asyncio.create_task(occupy())
    await asyncio.sleep(0)
    engine, served = FakeEngine(), []
    app = create_app(engine, EngineSlots(1), fair, token=TOKEN, served=served.append)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine.test",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.post("/v1/generate", json=JOB)
    [refusal] = lines(r)  # no Accepted line before it: the API has no record of it
    assert refusal["status"] == 429 and refusal["error"]["code"] == "resource_unavailable"
    assert "the bound on the default tier's wait" in refusal["error"]["message"]
    assert engine.generated == [] and served == [] and fair.waiting == 0
    hold.set()
    await held
