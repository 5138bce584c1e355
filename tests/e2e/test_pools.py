"""One deployment, two models: each engine worker announces its model and context length,
and the API and the batch runner send each model's work to that model's engines alone.

Model A is the session's tiny model (`ballast-tiny`, 1024 tokens of context); model B is
another tiny model (`ballast-tiny-b`, 512 tokens): the same tokenizer and shape, other
weights, so it answers the same prompts with other text. The stack is the test's own
(its engine serves A), with a second engine worker serving B.

The oracle is vLLM's own batch runner (`python -m vllm.entrypoints.openai.run_batch`), run
once per model over the same prompts, greedy, started in the background as soon as the
module starts so that it overlaps the stack's start-up; the two runs go one after the
other (two CPU cores). Every answer Ballast gives, chat or batch line, must be the oracle's
answer of the model asked for, and A's and B's oracle answers must differ (else a test
would pass with everything sent to one engine).

Routing is also read from the records: each chat's `request_served` record names the engine
worker that served it (journal/served.py), and the `engines` row of that id its model. A
batch item's chunks name the generation attempt that wrote them (`runner`: the workflow
run's tail, the activity id, the attempt); Temporal's history of that activity names the
worker that ran it (`pid@host`, the engine worker's process, whose engine id is
`host-pid`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from ballast import procs
from tests.e2e.conftest import WAIT_S, Stack, own_stack, vllm_paused
from tests.e2e.test_batch import _sql, read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e

A, B = "ballast-tiny", "ballast-tiny-b"
B_MAX_MODEL_LEN = 512
B_SEED = 4321

# custom_id → (prompt, max_tokens): the same for both models.
PROMPTS = {
    "hello": ("Hello!", 12),
    "story": ("Tell me a story.", 16),
    "fox": ("the quick brown fox", 10),
    "sum": ("1 + 1 =", 8),
}


def chat_line(custom_id: str, model: str, prompt: str | None = None, max_tokens: int | None = None) -> dict:
    """A greedy chat line for `model`; prompt and max_tokens default to PROMPTS[custom_id]'s."""
    p, n = PROMPTS.get(custom_id, ("", 0))
    body = dict(model=model, messages=[dict(role="user", content=prompt or p)], max_tokens=max_tokens or n,
                temperature=0)
    return dict(custom_id=custom_id, method="POST", url="/v1/chat/completions", body=body)


def lines_for(model: str) -> list[dict]:
    return [chat_line(cid, model) for cid in PROMPTS]


# -- the oracle: vLLM's own batch runner, once per model ---------------------------------


class Oracles:
    """vLLM's batch runner over each model's file, one model after the other, in a background
    thread; each run in a session of its own (stopped by killpg of its own pid)."""

    def __init__(self, root: Path, models: list[tuple[str, str, int]]):
        self.root = root
        self.done = {name: threading.Event() for name, _, _ in models}
        self.took: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run_all, args=(models,), name="vllm-oracles", daemon=True)
        self._thread.start()

    def _dir(self, name: str) -> Path:
        return self.root / name

    def _run_all(self, models: list[tuple[str, str, int]]) -> None:
        for name, path, max_len in models:
            try:
                self._run(name, path, max_len)
            except Exception as err:  # said where the test reads the results
                self.failed[name] = repr(err)
            finally:
                self.done[name].set()

    def _run(self, name: str, path: str, max_len: int) -> None:
        d = self._dir(name)
        d.mkdir(parents=True, exist_ok=True)
        src, out, log = d / "in.jsonl", d / "out.jsonl", d / "vllm.log"
        src.write_text("".join(json.dumps(ln) + "\n" for ln in lines_for(name)))
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out),
                "--model", path, "--served-model-name", name, "--max-model-len", str(max_len),
                "--dtype", "float32", "--enforce-eager",
                "--kv-cache-memory-bytes", str(512 << 20),  # on CPU a utilisation share would be of host memory
                "--max-num-seqs", "64", "--seed", "0", "--disable-log-stats"]
        t0 = time.monotonic()
        with self._lock:
            if self._stopped:
                self.failed[name] = "stopped before it started"
                return
            with log.open("wb") as f:
                proc = self._proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=d,
                                                     start_new_session=True,
                                                     env=dict(os.environ, VLLM_NO_USAGE_STATS="1"))
        rc = proc.wait()
        self.took[name] = round(time.monotonic() - t0, 1)
        if rc != 0:
            self.failed[name] = f"exit {rc}:\n" + log.read_text(errors="replace")[-6000:]

    def results(self, name: str, timeout: float = 600) -> dict[str, dict]:
        """The model's output lines by custom_id (waits for its run)."""
        assert self.done[name].wait(timeout), f"vLLM's batch runner for {name} still running after {timeout}s"
        assert name not in self.failed, f"vLLM's batch runner for {name} failed: {self.failed[name]}"
        lines = [json.loads(ln) for ln in (self._dir(name) / "out.jsonl").read_text().splitlines()]
        out = {ln["custom_id"]: ln for ln in lines}
        assert set(out) == set(PROMPTS), out
        for cid, ln in out.items():
            assert ln["response"]["status_code"] == 200, (name, cid, ln)
        return out

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: vLLM's engine core goes too
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        self._thread.join(60)


def _body(line: dict) -> dict:
    return line["response"]["body"]


def _content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def _usage(body: dict) -> tuple[int, int, int]:
    u = body["usage"]
    return u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> Path:
    from engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models-b"), max_model_len=B_MAX_MODEL_LEN, seed=B_SEED)


@pytest.fixture(scope="module")
def oracles(tmp_path_factory, tiny_model, model_b):
    """Started before the stack (the stack's fixture takes this one): they overlap."""
    assert (tiny_model.name, tiny_model.max_model_len) == (A, 1024)
    o = Oracles(tmp_path_factory.mktemp("vllm-oracles"),
                [(B, str(model_b), B_MAX_MODEL_LEN), (A, tiny_model.path, tiny_model.max_model_len)])
    try:
        yield o
    finally:
        o.stop()


@dataclass
class Pools:
    stack: Stack
    url: str  # the owner URL of the stack's database
    engines: dict[str, str]  # engine id → model, as the `engines` rows said while both were live
    engine_of: dict[str, str]  # model → the id of the engine worker the test started for it


def _live_engines(url: str) -> dict[str, str]:
    return dict(_sql(url, "SELECT id, model FROM engines WHERE seen_at > now() - interval '10 seconds'"))


@pytest.fixture(scope="module")
def pools(tmp_path_factory, pg_server_url, temporal_address, tiny_model, model_b, oracles):
    # Flex for A goes to B while A is busy; no flex floor, so one request makes an engine busy.
    with own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "pools",
                   BALLAST_FLEX_DOWNGRADE=json.dumps({A: B}), BALLAST_FLEX_MIN_SHARE="0") as (stack, url):
        engine_b = stack.start("engine-b", "worker", "engine", env=dict(
            BALLAST_MODEL=str(model_b), BALLAST_SERVED_MODEL_NAME=B, BALLAST_MAX_MODEL_LEN=str(B_MAX_MODEL_LEN),
            BALLAST_ENGINE_PORT=str(procs.free_port())))
        client = stack.openai()

        def listed() -> bool:
            try:
                return B in {m.id for m in client.models.list().data}
            except openai.APIError:
                return False

        procs.wait_until(listed, WAIT_S, f"{B} in the API's /v1/models", child=engine_b, interval=0.5)
        # The engine ids are `host-pid` of the engine worker processes (ballast/workers.py).
        host = socket.gethostname()
        engine_of = {A: f"{host}-{stack.engine.proc.pid}", B: f"{host}-{engine_b.proc.pid}"}
        procs.wait_until(lambda: set(engine_of.values()) <= set(_live_engines(url)), 30,
                         "both engine workers' rows", child=engine_b)
        engines = _live_engines(url)
        assert engines == {engine_of[A]: A, engine_of[B]: B}, engines  # each announced its own model
        yield Pools(stack, url, engines, engine_of)


@pytest.fixture(scope="module")
def client(pools):
    return pools.stack.openai()


@pytest.fixture(scope="module")
def chats(client) -> dict[tuple[str, str], ChatCompletion]:
    """(model, custom_id) → the ChatCompletion the official client got for that prompt."""
    out: dict[tuple[str, str], ChatCompletion] = {}
    for model in (A, B):
        for cid, (prompt, max_tokens) in PROMPTS.items():
            out[model, cid] = client.chat.completions.create(
                model=model, messages=[dict(role="user", content=prompt)], max_tokens=max_tokens, temperature=0)
    return out


def _run_batch(client, lines: list[dict]):
    done = wait_for(client, submit(client, lines).id, timeout=WAIT_S)
    assert done.status == "completed", done
    out = read_jsonl(client, done.output_file_id) if done.output_file_id else []
    errors = read_jsonl(client, done.error_file_id) if done.error_file_id else []
    return done, {o["custom_id"]: o for o in out}, {e["custom_id"]: e for e in errors}


@pytest.fixture(scope="module")
def b_batch(client):
    """B's lines as one batch, through the client: (batch, output lines, error lines) by custom_id."""
    return _run_batch(client, lines_for(B))


MIXED = [chat_line("hello", B), chat_line("stray", A, "Hello!", 12), chat_line("story", B)]


@pytest.fixture(scope="module")
def mixed_batch(client):
    """A batch of B (its first line's model) with one line naming A in the middle."""
    return _run_batch(client, MIXED)


# -- the tests ---------------------------------------------------------------------------


def test_the_models_listed_are_those_the_engines_serve(client):
    models = client.models.list().data
    assert sorted(m.id for m in models) == [A, B]  # each once; the tenant has no fine-tunes
    for name in (A, B):
        m = client.models.retrieve(name)
        assert (m.id, m.object) == (name, "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found"


def test_each_models_chats_are_vllms_answers_of_that_model(chats, oracles):
    theirs = {m: oracles.results(m) for m in (A, B)}
    print(f"\nvLLM's batch runner took {oracles.took} (s, each from its start)")
    # The two models really answer differently: had everything gone to one engine, some
    # answer below would be the other model's.
    differ = [cid for cid in PROMPTS if _content(_body(theirs[A][cid])) != _content(_body(theirs[B][cid]))]
    assert differ, {cid: _content(_body(theirs[A][cid])) for cid in PROMPTS}
    for (model, cid), ours in chats.items():
        want = _body(theirs[model][cid])
        got = ours.model_dump()
        assert ours.model == model
        assert _content(got) == _content(want), (model, cid)
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"], (model, cid)
        assert _usage(got) == _usage(want), (model, cid)


def test_each_model_has_its_own_context_length(client):
    # max_tokens beyond B's 512, within A's 1024.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=B, messages=[dict(role="user", content="Hi")], max_tokens=600,
                                       temperature=0)
    assert caught.value.body["code"] == "context_length_exceeded"
    r = client.chat.completions.create(model=A, messages=[dict(role="user", content="Hi")], max_tokens=600,
                                       temperature=0)
    assert r.model == A and 0 < r.usage.completion_tokens <= 600
    # A prompt of ~600 tokens (one a byte): room for 8 more in A's context, none in B's,
    # which only B's engine (whose vLLM has 512 tokens of context) can tell.
    long = [dict(role="user", content="z" * 600)]
    r = client.chat.completions.create(model=A, messages=long, max_tokens=8, temperature=0)
    assert r.model == A and r.usage.prompt_tokens > B_MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=B, messages=long, max_tokens=8, temperature=0)
    assert caught.value.body["code"] == "context_length_exceeded"


def test_a_batch_of_b_gives_vllms_answers_of_b(b_batch, oracles):
    done, out, errors = b_batch
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 4, 0)
    assert not errors and set(out) == set(PROMPTS)
    theirs = oracles.results(B)
    for cid, o in out.items():
        got, want = _body(o), _body(theirs[cid])
        assert o["response"]["status_code"] == 200 and got["model"] == B
        assert _content(got) == _content(want), cid
        assert _usage(got) == _usage(want), cid


def test_a_batch_line_naming_another_model_fails_alone(mixed_batch, oracles):
    done, out, errors = mixed_batch
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
    assert list(out) == ["hello", "story"] and list(errors) == ["stray"]
    stray = errors["stray"]["response"]
    assert stray["status_code"] == 404 and stray["body"]["error"]["code"] == "model_not_found", stray
    theirs = oracles.results(B)
    for cid, o in out.items():
        assert _body(o)["model"] == B
        assert _content(_body(o)) == _content(_body(theirs[cid])), cid


def _served(url: str, request_ids: list[str]) -> dict[str, tuple[str, str]]:
    """request id → (engine id, model) from the engines' records of what they served."""
    rows = _sql(url, """SELECT request_id, engine_id, record->>'model' FROM served_requests
                         WHERE request_id = ANY(%(s)s)""", s=request_ids)
    return {rid: (engine, model) for rid, engine, model in rows}


def _chunk_writers(url: str, batch_id: str) -> dict[str, set[str]]:
    """custom_id → the runners (generation attempts) that wrote the item's chunks."""
    rows = _sql(url, """
        SELECT c.payload->>'custom_id', k.payload->>'runner'
        FROM events c JOIN events k ON k.stream = c.stream AND k.type = 'item_chunk'
        WHERE c.type = 'item_created' AND c.stream LIKE %(s)s""", s=f"item:{batch_id}:%")
    out: dict[str, set[str]] = {}
    for cid, runner in rows:
        out.setdefault(cid, set()).add(runner)
    return out


async def _attempt_workers(temporal_address: str, batch_id: str, run_tails: set[str]) -> dict[str, str]:
    """runner (`run tail:activity id:attempt`) → the identity of the worker that ran that
    `generate` attempt, from the batch workflow's histories (every run named in `run_tails`)."""
    from temporalio.client import Client

    tc = await Client.connect(temporal_address)
    wid = f"batch:{batch_id}"
    deadline = time.monotonic() + 30
    while True:  # the visibility store may lag a run behind
        runs = [w.run_id async for w in tc.list_workflows(f"WorkflowId = '{wid}'")]
        if all(any(r.endswith(t) for r in runs) for t in run_tails) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    out = {}
    for run_id in runs:
        history = await tc.get_workflow_handle(wid, run_id=run_id).fetch_history()
        scheduled = {}
        for e in history.events:
            if e.HasField("activity_task_scheduled_event_attributes"):
                a = e.activity_task_scheduled_event_attributes
                if a.activity_type.name == "generate":
                    scheduled[e.event_id] = a.activity_id
            elif e.HasField("activity_task_started_event_attributes"):
                s = e.activity_task_started_event_attributes
                if s.scheduled_event_id in scheduled:
                    out[f"{run_id[-8:]}:{scheduled[s.scheduled_event_id]}:{s.attempt}"] = s.identity
    return out


def _engine_id(identity: str) -> str:
    """A Temporal worker's default identity (`pid@host`) as its engine id (`host-pid`)."""
    pid, _, host = identity.partition("@")
    return f"{host}-{pid}"


async def test_the_records_say_each_model_was_served_by_its_own_engines(pools, chats, b_batch, mixed_batch,
                                                                      temporal_address):
    # Chats: each engine worker records what it served, with its id and model.
    ids = {key: c.id for key, c in chats.items()}
    procs.wait_until(lambda: len(_served(pools.url, list(ids.values()))) == len(ids), 30,
                     "every chat's request_served record")
    served = _served(pools.url, list(ids.values()))
    for (model, cid), rid in ids.items():
        engine, recorded = served[rid]
        assert (engine, recorded) == (pools.engine_of[model], model), (model, cid, served[rid])
        assert pools.engines[engine] == model

    # Batch items: every chunk of every B item was written by an attempt that ran on B's engine.
    for name, (done, out, _) in (("B's batch", b_batch), ("the mixed batch", mixed_batch)):
        writers = _chunk_writers(pools.url, done.id)
        assert set(writers) == set(out), (name, writers)
        runners = set().union(*writers.values())
        workers = await _attempt_workers(temporal_address, done.id, {r.split(":")[0] for r in runners})
        for runner in runners:
            assert runner in workers, (name, runner, workers)
            engine = _engine_id(workers[runner])
            assert engine == pools.engine_of[B], (name, runner, workers[runner], pools.engines)
            assert pools.engines[engine] == B
    assert _live_engines(pools.url) == pools.engines  # both engine workers were there throughout


def _interactive(url: str, engine: str) -> int:
    return _sql(url, "SELECT (stats->>'interactive')::int FROM engines WHERE id = %(e)s", e=engine)[0][0]


def test_a_flex_chat_for_a_busy_model_is_answered_by_its_configured_smaller_model(pools, oracles):
    """BALLAST_FLEX_DOWNGRADE {A: B}: while every engine of A is busy, a flex chat for A is
    vLLM's own answer of B, and says so (`model`, x-ballast-downgraded-from); a default chat
    for A is still A's; once A is calm, flex for A is A's again. "Busy" is the surge
    threshold: a second API process here holds it at one request in flight (0.001 × 256)."""
    theirs = {m: oracles.results(m) for m in (A, B)}
    port = procs.free_port()
    pools.stack.start("api-busy", "api", env=dict(BALLAST_API_PORT=str(port), BALLAST_SURGE_HIGH="0.001",
                                                  BALLAST_SURGE_LOW="0.001"))
    busy_api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=pools.stack.key, max_retries=0)

    def up() -> bool:
        try:
            return B in {m.id for m in busy_api.models.list().data}
        except openai.APIError:
            return False

    procs.wait_until(up, WAIT_S, "the second API process", interval=0.5)
    prompt, max_tokens = PROMPTS["hello"]

    def chat(model: str, tier: str):
        raw = busy_api.chat.completions.with_raw_response.create(
            model=model, messages=[dict(role="user", content=prompt)], max_tokens=max_tokens, temperature=0,
            service_tier=tier)
        return raw.headers.get("x-ballast-downgraded-from"), raw.parse().model_dump()

    # A long stream on A keeps its engine busy meanwhile (from the main API: it counts there too).
    hold = httpx.Client(base_url=pools.stack.url, headers={"Authorization": f"Bearer {pools.stack.key}"}, timeout=120)
    with hold.stream("POST", "/v1/chat/completions", json=dict(
            model=A, messages=[dict(role="user", content="Keep talking.")], max_tokens=900, ignore_eos=True,
            stream=True)) as holding:
        assert holding.status_code == 200
        # A's vLLM stopped: the stream stays in flight however fast the tiny model would end it.
        with vllm_paused(pools.stack):
            procs.wait_until(lambda: _interactive(pools.url, pools.engine_of[A]) >= 1, 30,
                             "A's engine reports the stream")
            time.sleep(1.0)  # the second API's view of the engines refreshes every 0.5 s
            moved, flex = chat(A, "flex")
        kept, default = chat(A, "default")
    hold.close()
    want_b, want_a = _body(theirs[B]["hello"]), _body(theirs[A]["hello"])
    assert moved == A and flex["model"] == B
    assert _content(flex) == _content(want_b) and _usage(flex) == _usage(want_b)
    assert kept is None and default["model"] == A and _content(default) == _content(want_a)

    # The engine reports its peak over its last few reports: calm again within seconds.
    procs.wait_until(lambda: _interactive(pools.url, pools.engine_of[A]) == 0, 30, "A's engine calm")
    time.sleep(1.0)
    calm, again = chat(A, "flex")
    assert calm is None and again["model"] == A and _content(again) == _content(want_a)

    # The journal says which model served each and which was asked (SQL over its records).
    def records() -> dict[str, dict]:
        rows = _sql(pools.url, "SELECT request_id, record FROM finished_requests WHERE request_id = ANY(%(r)s)",
                    r=[flex["id"], default["id"]])
        return {rid: record for rid, record in rows}

    procs.wait_until(lambda: len(records()) == 2, WAIT_S, "the two chats journaled")
    journaled = records()
    assert (journaled[flex["id"]]["model"], journaled[flex["id"]]["downgraded_from"]) == (B, A)
    assert (journaled[default["id"]]["model"], journaled[default["id"]].get("downgraded_from")) == (A, None)
