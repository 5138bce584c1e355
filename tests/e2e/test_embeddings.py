"""Embeddings, interactive and in batches, equal to vLLM's own.

The stack is the module's own: its engine worker runs the tiny model in vLLM's pooling mode
(BALLAST_MODEL_TASK=embed, served as `ballast-tiny-embed`). The oracle is vLLM's batch
runner (`python -m vllm.entrypoints.openai.run_batch --runner pooling`, started in the
background as the module starts, on the same model and engine settings): vLLM's own
OpenAI layer answers each line, float and base64 alike. Ballast must give the same
vectors (to float32 rounding: batches of other shapes sum in other orders) and the same
usage, through the official client (which asks for base64 by default and decodes it
itself) and in a batch's output file, while interactive embeddings arrive meanwhile; and
what vLLM refuses, Ballast refuses. The books come from SQL over the journal: every
request and item settled in the ledger at the prompt tokens its usage said, none of
output, and the batch items' prompt tokens re-counted by transformers (`ballast verify`'s
item_prompts_retokenized) all agree. Items run whole: an engine worker SIGKILLed part way
through a batch leaves each item completed and settled once, every vector vLLM's.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import psycopg
import pytest

from ballast import procs
from config.database import libpq_url
from journal import invariants
from tests.e2e.conftest import WAIT_S, own_stack
from tests.e2e.test_batch import read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e

MODEL = "ballast-tiny-embed"
TOLERANCE = 1e-5  # per component, of unit vectors: float32 sums in another order

# custom_id → body: each input form OpenAI names, both encodings, vLLM's add_special_tokens.
LINES: dict[str, dict[str, Any]] = {
    "one": dict(input="The quick brown fox."),
    "many": dict(input=["first text", "a second, longer text to embed", "3"]),
    "ids": dict(input=[5, 17, 99, 4]),
    "id-lists": dict(input=[[5, 17], [99, 4, 3, 2, 1]]),
    "base64": dict(input=["encoded as base64"], encoding_format="base64"),
    "no-specials": dict(input="without special tokens", add_special_tokens=False),
    "long": dict(input="word " * 150),
}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {  # with the parameter Ballast's 400 names
    "dimensions": (dict(input="cut short", dimensions=8), "dimensions"),  # the tiny model has no Matryoshka ones
    "too-long": (dict(input="word " * 300), "input"),  # past the context
}


def _line(cid: str, body: dict) -> dict:
    return dict(custom_id=cid, method="POST", url="/v1/embeddings", body=dict(model=MODEL, **body))


class Oracle:
    """vLLM's batch runner over LINES and REFUSED, in a background thread, in a session of
    its own (so that the test's end can stop it by its own process group)."""

    def __init__(self, root: Path, model_path: str, max_len: int):
        self.root, self.proc = root, cast(subprocess.Popen | None, None)
        self.out, self.log = root / "out.jsonl", root / "vllm.log"
        src = root / "in.jsonl"
        lines = [_line(cid, b) for cid, b in LINES.items()] + [_line(cid, b) for cid, (b, _) in REFUSED.items()]
        src.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(self.out),
                     "--model", model_path, "--served-model-name", MODEL, "--runner", "pooling",
                     "--max-model-len", str(max_len), "--dtype", "float32", "--enforce-eager",
                     "--kv-cache-memory-bytes", str(512 << 20), "--seed", "0", "--disable-log-stats"]
        self.rc: int | None = None
        self.thread = threading.Thread(target=self._run, name="vllm-embeddings-oracle", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, cwd=self.root,
                                         start_new_session=True, env=dict(os.environ, VLLM_NO_USAGE_STATS="1"))
        self.rc = self.proc.wait()

    def results(self, timeout: float = 600) -> dict[str, dict]:
        self.thread.join(timeout)
        assert self.rc == 0, f"vLLM's batch runner: exit {self.rc}\n" + self.log.read_text(errors="replace")[-4000:]
        return {ln["custom_id"]: ln for ln in map(json.loads, self.out.read_text().splitlines())}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_model):
    o = Oracle(tmp_path_factory.mktemp("embeddings-oracle"), tiny_model.path, tiny_model.max_model_len)
    try:
        yield o
    finally:
        o.stop()


@pytest.fixture(scope="module")
def embedding_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, oracle):
    with own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "embed",
                   BALLAST_MODEL_TASK="embed", BALLAST_SERVED_MODEL_NAME=MODEL, BALLAST_TOOL_CALL_PARSER="") as got:
        yield got


def _floats(embedding) -> list[float]:
    if isinstance(embedding, str):
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return embedding


def _same(ours: list[dict], theirs: list[dict], what: str) -> None:
    """Data entries alike: index, object, and each vector within TOLERANCE."""
    assert [d["index"] for d in ours] == [d["index"] for d in theirs], what
    for a, b in zip(ours, theirs, strict=True):
        va, vb = _floats(a["embedding"]), _floats(b["embedding"])
        assert type(a["embedding"]) is type(b["embedding"]), (what, "encoding")
        assert len(va) == len(vb) > 0, what
        worst = max(abs(x - y) for x, y in zip(va, vb, strict=True))
        assert worst <= TOLERANCE, (what, a["index"], worst)


def test_embeddings_equal_vllms_own_interactive_and_in_a_batch(embedding_stack, oracle, tiny_model):
    stack, db_url = embedding_stack
    client, http = stack.openai(), stack.http()
    vllm = oracle.results()
    for cid in LINES:
        assert vllm[cid]["response"]["status_code"] == 200, vllm[cid]

    # The batch, while interactive requests arrive: the items queue and run whole.
    batch = submit(client, [_line(cid, b) for cid, b in LINES.items()], endpoint="/v1/embeddings")

    def interactive(cid: str) -> tuple[str, httpx.Response]:
        return cid, http.post("/v1/embeddings", json=dict(model=MODEL, **LINES[cid]))

    with ThreadPoolExecutor(4) as pool:
        answers = dict(pool.map(interactive, list(LINES) * 2))  # each twice, the batch meanwhile
    for cid, r in answers.items():
        assert r.status_code == 200, (cid, r.text)
        body, theirs = r.json(), vllm[cid]["response"]["body"]
        assert body["object"] == "list" and body["model"] == MODEL, body
        _same(body["data"], theirs["data"], cid)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == theirs["usage"]["prompt_tokens"]

    # The official client: base64 on the wire by default, decoded to floats by the client itself.
    got = client.embeddings.create(model=MODEL, input=LINES["many"]["input"])
    expected = vllm["many"]["response"]["body"]["data"]
    _same([dict(index=d.index, embedding=d.embedding) for d in got.data], expected, "official client")
    assert got.usage.prompt_tokens == vllm["many"]["response"]["body"]["usage"]["prompt_tokens"]

    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(LINES), done
    assert done.error_file_id is None
    out = {ln["custom_id"]: ln for ln in read_jsonl(client, done.output_file_id)}
    assert list(out) == list(LINES)  # input order
    for cid, ln in out.items():
        assert ln["response"]["status_code"] == 200, ln
        _same(ln["response"]["body"]["data"], vllm[cid]["response"]["body"]["data"], f"batch {cid}")
        assert ln["response"]["body"]["usage"]["prompt_tokens"] == vllm[cid]["response"]["body"]["usage"][
            "prompt_tokens"]

    # The books, in SQL: the batch's items and every request settled at the prompt tokens its
    # usage said (the client's record: 2 per line, and the official client's), nothing of
    # output, and no item preempted part way.
    said = sum(vllm[cid]["response"]["body"]["usage"]["prompt_tokens"] for cid in LINES)
    asked = 2 * said + got.usage.prompt_tokens
    deadline = time.monotonic() + 60
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        items = conn.execute("""SELECT sum(input_tokens), sum(output_tokens), count(*) FROM ledger
                                 WHERE kind = 'settle' AND subject LIKE %s""", (f"item:{done.id}:%",)).fetchone()
        preempted = conn.execute("SELECT count(*) FROM events WHERE type = 'item_preempted'").fetchone()[0]
        while (requests := conn.execute("""SELECT coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0),
                                                  count(*) FROM ledger
                                            WHERE kind = 'settle' AND subject LIKE 'request:embd-%%'""").fetchone()
               ) != (asked, 0, 2 * len(LINES) + 1):
            assert time.monotonic() < deadline, (requests, asked)
            time.sleep(0.5)
    assert items == (said, 0, len(LINES)) and preempted == 0
    found = {f.check.name: f for f in invariants.audit(db_url, tokenizer=tiny_model.path)}
    assert all(f.ok for f in found.values()), [f for f in found.values() if not f.ok]
    assert found["item_prompts_retokenized"].examined == len(LINES)


def test_what_vllm_refuses_is_refused_and_embedding_models_serve_nothing_else(embedding_stack, oracle):
    stack, _ = embedding_stack
    http = stack.http()
    vllm = oracle.results()
    for cid, (body, param) in REFUSED.items():
        r = http.post("/v1/embeddings", json=dict(model=MODEL, **body))
        assert 400 <= vllm[cid]["response"]["status_code"] < 500, vllm[cid]
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (cid, r.text)
    bad = [(dict(input=""), "input"), (dict(input=[]), "input"), (dict(input=["a", [1, 2]]), "input"),
           (dict(input="x", encoding_format="int8"), "encoding_format"), (dict(input="x", truncate=3), "truncate"),
           (dict(input=[2 ** 31]), "input")]
    for body, param in bad:
        r = http.post("/v1/embeddings", json=dict(model=MODEL, **body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/v1/embeddings", json=dict(model="nope", input="x"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    # An embedding model generates nothing: a chat or completion for it is a 400 naming it.
    for path, body in (("/v1/chat/completions", dict(messages=[dict(role="user", content="hi")])),
                       ("/v1/completions", dict(prompt="hi"))):
        r = http.post(path, json=dict(model=MODEL, **body))
        assert r.status_code == 400 and MODEL in r.json()["error"]["message"], r.text
    # Nor is it fine-tuned: its engines serve no adapters.
    r = http.post("/v1/fine_tuning/jobs", json=dict(model=MODEL, training_file="file-" + "0" * 24))
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_available", r.text
    # And a batch of chats for it fails each line, saying why.
    client = stack.openai()
    chat = dict(custom_id="c", method="POST", url="/v1/chat/completions",
                body=dict(model=MODEL, messages=[dict(role="user", content="hi")], max_tokens=4))
    done = wait_for(client, submit(client, [chat]).id, timeout=120)
    assert done.request_counts.failed == 1, done
    (err,) = read_jsonl(client, done.error_file_id)
    assert err["response"]["status_code"] == 400 and "embedding model" in json.dumps(err), err


def test_an_engine_worker_killed_mid_batch_leaves_each_item_embedded_once(embedding_stack, oracle):
    """Items run whole: a SIGKILL part way through a batch loses the items in flight, which
    the new worker embeds anew; each item is completed (and settled) once, and equal to vLLM's."""
    stack, db_url = embedding_stack
    client, vllm = stack.openai(), oracle.results()
    kinds = ["long", "many", "one", "id-lists"]
    lines = [_line(f"k{i}-{kinds[i % len(kinds)]}", LINES[kinds[i % len(kinds)]]) for i in range(400)]
    batch = submit(client, lines, endpoint="/v1/embeddings")
    like = f"item:{batch.id}:%"

    def sql(query: str) -> list[tuple]:
        with psycopg.connect(libpq_url(db_url)) as conn:
            return conn.execute(query, (like,)).fetchall()

    completed = "SELECT count(*) FROM events WHERE type = 'item_completed' AND stream LIKE %s"
    deadline = time.monotonic() + WAIT_S
    while sql(completed)[0][0] < 10:
        assert time.monotonic() < deadline, "no item embedded"
        time.sleep(0.05)
    victim = stack.engine
    try:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        procs.wait_until(lambda: not procs.group_members(victim.pid), 10, "the worker's vLLM processes to die")
        assert 10 <= sql(completed)[0][0] < len(lines)  # the kill landed mid-batch
    finally:
        stack.start_engine()
    stack.wait_healthy()
    done = wait_for(client, batch.id, timeout=600)
    assert done.status == "completed" and done.request_counts.completed == len(lines), done
    out = read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [ln["custom_id"] for ln in lines]
    for o in out:
        kind = o["custom_id"].split("-", 1)[1]
        _same(o["response"]["body"]["data"], vllm[kind]["response"]["body"]["data"], o["custom_id"])
    once = sql("""SELECT count(*), count(DISTINCT stream) FROM events WHERE type = 'item_completed'
                   AND stream LIKE %s""")[0]
    settled = sql("SELECT count(*), count(DISTINCT subject) FROM ledger WHERE kind = 'settle' AND subject LIKE %s")[0]
    assert once == settled == (len(lines), len(lines))
