"""vLLM itself as the oracle: the same batch files, run by vLLM's own OpenAI layer and by
Ballast, must give the same results line for line (greedy, the tiny model, float32).

vLLM side, in one subprocess (one start-up): the chat file goes through vLLM's batch
runner itself (`run_batch` of `vllm.entrypoints.launchers.run_batch`, what
`python -m vllm.entrypoints.openai.run_batch` / `vllm run_batch` run); the completions
file through vLLM's `/v1/completions` handler (`OpenAIServingCompletion`, what
`vllm serve` routes to), wrapped in run_batch's output shape, because vLLM 0.32's
run_batch has no /v1/completions: it cannot even parse such a line.

Compared per custom_id: for a success, the text (message content), finish_reason and
usage; for a failure, that both sides answer 4xx. How the two error lines differ in
shape is printed (run with -s), not asserted: vLLM's batch runner puts an ErrorResponse
in the line's `error` with `response.body` null, where OpenAI (and Ballast) put the error
body in `response.body`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_batch import read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e

MODEL = "ballast-tiny"
CHAT = "/v1/chat/completions"


def chat(cid: str, content: str, max_tokens: int, **extra) -> dict:
    body = dict(model=MODEL, messages=[dict(role="user", content=content)], max_tokens=max_tokens,
                temperature=0, **extra)
    return dict(custom_id=cid, method="POST", url="/v1/chat/completions", body=body)


def completion(cid: str, prompt: str | list[int], max_tokens: int, **extra) -> dict:
    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)
    return dict(custom_id=cid, method="POST", url="/v1/completions", body=body)


# max_tokens picked (from the tiny model's greedy outputs) so that most lines end inside a
# multi-byte character; "clean" ones end between characters.
# Sampling parameters beyond temperature and top_p, and logprobs: each as vLLM's OpenAI
# layer takes it. Greedy, so the penalties and biases decide which token wins.
# Structured outputs. The tiny model would pad JSON with whitespace up to max_tokens; a bias
# keeps it brief (a byte's token id is the byte).
BRIEF = {str(ord(c)): -100 for c in " \t\r\n"}
PERSON = {"type": "object", "required": ["name", "age", "kind"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["cat", "dog", "eel"]}}}
NUMBERS = {"type": "array", "items": {"type": "integer", "maximum": 999}, "minItems": 2, "maxItems": 5}
SCHEMAS = {"j-person": PERSON, "j-numbers": NUMBERS, "j-person-penalised": PERSON}
STRUCTURED = [
    chat("j-person", "Who is it?", 96, logit_bias=BRIEF,
         response_format=dict(type="json_schema", json_schema=dict(name="person", schema=PERSON, strict=True))),
    chat("j-numbers", "Some numbers", 64, logit_bias=BRIEF,
         response_format=dict(type="json_schema", json_schema=dict(name="numbers", schema=NUMBERS))),
    chat("j-object", "Any object", 64, logit_bias=BRIEF, response_format=dict(type="json_object")),
    chat("j-person-penalised", "And now?", 96, logit_bias=BRIEF, presence_penalty=0.5, frequency_penalty=0.8,
         logprobs=True, top_logprobs=2,
         response_format=dict(type="json_schema", json_schema=dict(name="person", schema=PERSON))),
    chat("j-regex", "A code", 24, structured_outputs=dict(regex=r"[a-z]{3,8}-\d{2,4}")),
    chat("j-choice", "Pick one", 12, structured_outputs=dict(choice=["alpha", "beta", "gamma delta"])),
]

SAMPLING_CHAT = [
    chat("s-logprobs", "Zürich in winter", 12, logprobs=True, top_logprobs=5),
    chat("s-logprobs-0", "привет, мир", 9, logprobs=True),
    chat("s-logprobs-eos", "résumé tips", 64, logprobs=True, top_logprobs=2),
    chat("s-presence", "Tell me a story.", 24, presence_penalty=1.5),
    chat("s-frequency", "Tell me a story.", 24, frequency_penalty=-1.2, logprobs=True, top_logprobs=1),
    chat("s-repetition", "the quick brown fox", 24, repetition_penalty=1.8),
    chat("s-logit-bias", "1 + 1 =", 12, logit_bias={"101": 8.5, "32": -100}),
    chat("s-top-k", "la mer", 10, top_k=3, min_p=0.2),
    chat("s-min-tokens", "résumé tips", 24, min_tokens=20),
    chat("s-stop-ids", "Tell me a story.", 40, stop_token_ids=[110, 1]),  # byte tokens: "n"
    chat("s-stop-incl", "Tell me a story.", 64, stop=["\u00ef"], include_stop_str_in_output=True),
    chat("s-specials", "résumé tips", 64, skip_special_tokens=False, spaces_between_special_tokens=False),
    chat("s-template", "hello", 6, chat_template_kwargs={"unused_variable": 1}),
    chat("s-bias-oov", "hello", 6, logit_bias={"999999": 1}),
    *STRUCTURED,
]
SAMPLING_COMPLETIONS = [
    completion("q-logprobs", "Once upon a time", 9, logprobs=3),
    completion("q-logprobs-0", "日本語テキスト", 11, logprobs=0),
    completion("q-logprobs-20", "🚀 launch", 6, logprobs=20),
    completion("q-penalties", "x = 1\n", 20, presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.3),
    completion("q-min-tokens-stop", "Zürich", 30, min_tokens=12, stop=["M"]),
    completion("q-stop-ids-logprobs", "Once upon a time", 30, stop_token_ids=[32], logprobs=2),
]

CHAT_LINES = [
    chat("c-mid-1", "Hello!", 10),
    chat("c-mid-2", "Tell me a story.", 12),
    chat("c-mid-3", "Zürich in winter", 13),
    chat("c-mid-4", "привет, мир", 9),
    chat("c-mid-5", "日本語で話して", 8),
    chat("c-mid-6", "emoji 🚀🧪 please", 17),
    chat("c-mid-7", "def f(x):", 20),
    chat("c-mid-8", "the quick brown fox", 14),
    chat("c-mid-9", "la mer", 11),
    chat("c-clean-1", "1 + 1 =", 5),
    chat("c-clean-2", "haiku about GPUs", 24),
    chat("c-eos", "résumé tips", 64),  # greedy ends on EOS after 15 tokens
    chat("c-stop", "Tell me a story.", 64, stop=["\u00ef", "never\u00ff"]),  # a 2-byte stop string
    chat("c-stop-str", "1 + 1 =", 64, stop="n3n"),
    chat("c-too-long", "fine", 5000),  # beyond the 1024-token context
    chat("c-over-by-one", "z" * 1000, 1024 - 1004 + 1),  # the prompt is 1004 tokens (a known difference)
    dict(chat("c-no-model", "fine", 8), body=dict(chat("x", "fine", 8)["body"], model="gpt-9")),
    *SAMPLING_CHAT,
]
COMPLETION_LINES = [
    completion("p-mid-1", "Once upon a time", 9),
    completion("p-mid-2", "Zürich", 7),
    completion("p-mid-3", "привет", 16),
    completion("p-mid-4", "日本語テキスト", 11),
    completion("p-mid-5", "🚀 launch", 10),
    completion("p-clean-1", "x = 1\n", 12),
    # A token prompt ending inside "é" (BOS "héllo " and é's first byte): vLLM primes its
    # decoder with the prompt, and so the prompt's text shows up in the completion.
    completion("p-ids-cut", [256, 104, 195, 169, 108, 108, 111, 32, 195], 5),
    completion("p-stop", "Zürich", 64, stop=["MMM"]),
    completion("p-too-long", "fine", 5000),
    dict(completion("p-no-model", "fine", 8), body=dict(completion("x", "fine", 8)["body"], model="gpt-9")),
    *SAMPLING_COMPLETIONS,
]

DRIVER = r'''
import asyncio, json, os, sys


async def main(args):
    from starlette.datastructures import State
    from vllm.entrypoints.launchers import run_batch as rb
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
    from vllm.entrypoints.serve import create_error_response
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils import random_uuid

    rb.validate_run_batch_args(args)
    async with build_async_engine_client(args, usage_context=UsageContext.OPENAI_BATCH_RUNNER) as client:
        state = State()
        await rb.init_app_state(client, state, args, await client.get_supported_tasks())
        serving = state.openai_serving_completion

        async def one(line):
            try:
                r = await serving.create_completion(CompletionRequest.model_validate(line["body"]))
            except Exception as e:
                r = create_error_response(e)
            out = dict(id=f"vllm-{random_uuid()}", custom_id=line["custom_id"])
            if isinstance(r, CompletionResponse):
                out.update(response=dict(status_code=200, request_id=f"vllm-batch-{random_uuid()}",
                                         body=r.model_dump(mode="json")), error=None)
            else:
                assert isinstance(r, ErrorResponse), r
                out.update(response=dict(status_code=r.error.code, request_id=f"vllm-batch-{random_uuid()}",
                                         body=None), error=r.model_dump(mode="json"))
            return out

        async def completions():
            lines = [json.loads(ln) for ln in open(os.environ["ORACLE_COMPLETIONS_IN"]) if ln.strip()]
            outs = await asyncio.gather(*map(one, lines))
            with open(os.environ["ORACLE_COMPLETIONS_OUT"], "w") as f:
                f.writelines(json.dumps(o) + "\n" for o in outs)

        await asyncio.gather(rb.run_batch(client, args), completions())


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    from vllm.entrypoints.launchers.run_batch import parse_args

    asyncio.run(main(parse_args()))
'''


def vllm_args(model_path: str, chat_in: Path, chat_out: Path) -> list[str]:
    """The flags `python -m vllm.entrypoints.openai.run_batch` takes for the tiny model on a CPU."""
    return [
        "-i", str(chat_in), "-o", str(chat_out),
        "--model", model_path, "--served-model-name", MODEL,
        "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(512 << 20),  # on CPU a utilisation share would be of host memory
        "--max-num-seqs", "64", "--seed", "0", "--disable-log-stats",
    ]


def _jsonl(lines: list[dict]) -> str:
    return "".join(json.dumps(ln, ensure_ascii=False) + "\n" for ln in lines)


class VllmRun:
    """vLLM's side, started in the background so that it starts up while Ballast's does."""

    def __init__(self, root: Path, model_path: str):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.chat_in, self.chat_out = root / "chat.jsonl", root / "chat.out.jsonl"
        self.comp_in, self.comp_out = root / "completions.jsonl", root / "completions.out.jsonl"
        self.chat_in.write_text(_jsonl(CHAT_LINES))
        self.comp_in.write_text(_jsonl(COMPLETION_LINES))
        (root / "driver.py").write_text(DRIVER)
        self.log = root / "vllm.log"
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1", ORACLE_COMPLETIONS_IN=str(self.comp_in),
                   ORACLE_COMPLETIONS_OUT=str(self.comp_out))
        self.proc = subprocess.Popen(
            [sys.executable, str(root / "driver.py"), *vllm_args(model_path, self.chat_in, self.chat_out)],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=root,
            start_new_session=True,
        )

    def results(self, timeout: float = 600) -> dict[str, dict]:
        rc = self.proc.wait(timeout)
        assert rc == 0, self.log.read_text()[-6000:]
        lines = [json.loads(ln) for p in (self.chat_out, self.comp_out) for ln in p.read_text().splitlines()]
        return {ln["custom_id"]: ln for ln in lines}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # its own session: the engine core goes too
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory, tiny_model):
    run = VllmRun(tmp_path_factory.mktemp("vllm-oracle"), tiny_model.path)
    try:
        yield run
    finally:
        run.stop()


# Where the two are known to disagree, and why; checked to be exactly this, so that a
# change on either side shows.
KNOWN = {
    # vLLM 0.32 refuses only max_tokens > max_model_len; a prompt + max_tokens beyond the
    # context runs, capped by it (finish_reason "length"). Ballast refuses it as OpenAI does
    # (400 context_length_exceeded).
    "c-over-by-one": ["c-over-by-one: status 400 (Ballast) vs 200 (vLLM)"],
}


def valid_structured(bodies: dict[str, dict]) -> None:
    """Each structured output that ended on its own is what it was asked to be, by a
    validator that is not the engine's (jsonschema_rs, not xgrammar)."""
    import jsonschema_rs

    for cid, body in bodies.items():
        if not cid.startswith("j-") or body["choices"][0]["finish_reason"] != "stop":
            continue
        text = _text(body) or ""
        if cid in SCHEMAS:
            assert jsonschema_rs.validator_for(SCHEMAS[cid]).is_valid(json.loads(text)), (cid, text)
        elif cid == "j-object":
            assert isinstance(json.loads(text), dict), text
        elif cid == "j-regex":
            assert re.fullmatch(r"[a-z]{3,8}-\d{2,4}", text), text
        else:
            assert text in ("alpha", "beta", "gamma delta"), text
    assert sum(cid.startswith("j-") and b["choices"][0]["finish_reason"] == "stop" for cid, b in bodies.items()) >= 4


def tokens_of(body: dict) -> int:
    return body["usage"]["completion_tokens"]


def _text(endpoint_body: dict) -> str | None:
    c = endpoint_body["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def compare(custom_id: str, ours: dict, theirs: dict) -> list[str]:
    """What differs between Ballast's line and vLLM's, as messages; [] when they agree."""
    ours_status, theirs_status = ours["response"]["status_code"], theirs["response"]["status_code"]
    if theirs_status != 200 or ours_status != 200:
        if ours_status // 100 == theirs_status // 100 == 4:
            return []
        return [f"{custom_id}: status {ours_status} (Ballast) vs {theirs_status} (vLLM)"]
    a, b = ours["response"]["body"], theirs["response"]["body"]
    diffs = []
    for what, x, y in [
        ("text", _text(a), _text(b)),
        ("finish_reason", a["choices"][0]["finish_reason"], b["choices"][0]["finish_reason"]),
        *[(f"usage.{k}", a["usage"][k], b["usage"][k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens")],
    ]:
        if x != y:
            diffs.append(f"{custom_id}: {what} {x!r} (Ballast) vs {y!r} (vLLM)")
    if not close(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]):
        diffs.append(f"{custom_id}: logprobs {json.dumps(a['choices'][0]['logprobs'])[:400]} (Ballast) vs "
                     f"{json.dumps(b['choices'][0]['logprobs'])[:400]} (vLLM)")
    return diffs


FLOOR = -9999.0


def close(ours, theirs, tol: float = 1e-4) -> bool:
    """Equal, numbers within `tol` (two engine runs' float32 logprobs); OpenAI's `refusal`,
    which vLLM's chat logprobs lack, aside. Alternatives a grammar rules out have logprob
    -inf (-9999 on the wire): which of them fill the top k is a tie, broken as topk breaks
    it, so such alternatives are equal whatever token they name."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if ours.get("logprob") == theirs.get("logprob") == FLOOR and "top_logprobs" not in ours:
            return True  # a ruled-out alternative
        if ours and all(isinstance(v, float) for v in [*ours.values(), *theirs.values()]):  # completions' top
            a, b = ({k: v for k, v in d.items() if v != FLOOR} for d in (ours, theirs))
            return (len(ours) - len(a) == len(theirs) - len(b) and a.keys() == b.keys()
                    and all(abs(a[k] - b[k]) <= tol for k in a))
        ours = {k: v for k, v in ours.items() if not (k == "refusal" and v is None and k not in theirs)}
        return ours.keys() == theirs.keys() and all(close(ours[k], theirs[k], tol) for k in ours)
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(close(x, y, tol) for x, y in zip(ours, theirs, strict=True))
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and abs(ours - theirs) <= tol
    return ours == theirs


def _tokens(db_url: str, batch_id: str) -> dict[str, list[int]]:
    """Each item's output tokens, from Ballast's journal."""
    from tests.e2e.test_batch import _sql

    rows = _sql(db_url, """
        SELECT c.payload->>'custom_id', (k.payload->>'offset')::int, k.payload->'token_ids'
        FROM events c JOIN events k ON k.stream = c.stream AND k.type = 'item_chunk'
        WHERE c.type = 'item_created' AND c.stream LIKE %(s)s ORDER BY 1, 2""", s=f"item:{batch_id}:%")
    out: dict[str, list[int]] = {}
    for cid, _, ids in rows:
        out.setdefault(cid, []).extend(ids)
    return out


async def test_batch_output_equals_vllms_own(vllm_run, stack, client, db_url, tiny_model):
    t0 = time.monotonic()  # vLLM is starting (or done) in the background meanwhile
    batches = await asyncio.gather(
        asyncio.to_thread(submit, client, CHAT_LINES),
        asyncio.to_thread(submit, client, COMPLETION_LINES, endpoint="/v1/completions"),
    )
    ours: dict[str, dict] = {}
    tokens: dict[str, list[int]] = {}
    for b in batches:
        done = await asyncio.to_thread(wait_for, client, b.id)
        assert done.status == "completed", done
        for f in (done.output_file_id, done.error_file_id):
            if f:
                ours.update((o["custom_id"], o) for o in await asyncio.to_thread(read_jsonl, client, f))
        tokens.update(_tokens(db_url, b.id))
    t_ballast = time.monotonic() - t0
    theirs = await asyncio.to_thread(vllm_run.results)
    (vllm_run.root / "ballast.out.jsonl").write_text(_jsonl(list(ours.values())))  # beside vLLM's, to read

    ids = [ln["custom_id"] for ln in CHAT_LINES + COMPLETION_LINES]
    assert set(ours) == set(theirs) == set(ids)
    diffs = {cid: compare(cid, ours[cid], theirs[cid]) for cid in ids}
    equal = sum(not d for d in diffs.values())
    unexpected = {cid: d for cid, d in diffs.items() if d != KNOWN.get(cid, [])}

    # The lines that tell an incremental detokenizer from a plain decode: those ending
    # inside a character (read from the tokens Ballast journaled).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    mid = [cid for cid, t in tokens.items() if tok.decode(t, skip_special_tokens=True).endswith("\ufffd")]

    print(f"\n{equal}/{len(ids)} lines equal ({len(mid)} end inside a character: {sorted(mid)}); "
          f"Ballast ran both batches in {t_ballast:.1f}s")
    for cid in ids:
        o, t = ours[cid], theirs[cid]
        if t["response"]["status_code"] != 200:
            for who, x in (("Ballast", o), ("vLLM", t)):
                print(f"{cid}: {who:7} {x['response']['status_code']} "
                      f"response.body={json.dumps(x['response'].get('body'))} error={json.dumps(x.get('error'))}")
    for d in diffs.values():
        for line in d:
            print("DIFF", line, "(known)" if line in KNOWN.get(line.split(":")[0], []) else "")

    assert len(mid) >= 8, mid
    assert all(ours[c]["response"]["status_code"] == 200 for c in mid)
    assert {c for c in ids if theirs[c]["response"]["status_code"] != 200} == {
        "c-too-long", "c-no-model", "p-too-long", "p-no-model", "s-bias-oov"}
    # The sampling lines do what they say on vLLM's side (else equal outputs would prove little).
    body = {c: theirs[c]["response"]["body"] for c in ids if theirs[c]["response"]["status_code"] == 200}
    assert len(body["s-logprobs"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5
    assert len(body["q-logprobs-20"]["choices"][0]["logprobs"]["top_logprobs"][0]) > 10  # by text: some collide
    assert body["s-min-tokens"]["usage"]["completion_tokens"] >= 20 > tokens_of(body["c-eos"])
    assert body["s-stop-ids"]["choices"][0]["finish_reason"] == "stop"
    assert _text(body["s-stop-incl"]).endswith("\u00ef")
    valid_structured(body)
    for plain, varied in (("c-stop", "s-presence"), ("c-stop", "s-repetition"), ("c-clean-1", "s-logit-bias"),
                          ("c-stop", "s-frequency")):
        assert _text(body[plain])[:20] != _text(body[varied])[:20], (plain, varied)
    assert theirs["c-stop"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert theirs["p-stop"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert not unexpected, "\n".join(x for d in unexpected.values() for x in d)
    assert equal == len(ids) - len(KNOWN)


INTERACTIVE = ["s-logprobs", "s-logprobs-eos", "s-frequency", "s-stop-ids", "s-specials", "q-logprobs",
               "q-stop-ids-logprobs", "q-penalties", "j-person", "j-regex"]


async def test_interactive_equals_vllms_own(vllm_run, stack, client):
    """The same bodies through the official client, whole and streamed, against vLLM's
    answers to the batch lines."""
    theirs = await asyncio.to_thread(vllm_run.results)
    lines = {ln["custom_id"]: ln for ln in CHAT_LINES + COMPLETION_LINES}
    diffs = []
    for cid in INTERACTIVE:
        line, want = lines[cid], theirs[cid]
        create = client.chat.completions.create if line["url"] == CHAT else client.completions.create
        whole = (await asyncio.to_thread(create, **_sdk(line["body"]))).model_dump(mode="json")
        diffs += compare(cid, dict(response=dict(status_code=200, body=whole)), want)
        streamed = await asyncio.to_thread(_streamed, create, line["body"])
        diffs += compare(f"{cid} (streamed)", dict(response=dict(status_code=200, body=streamed)), want)
    assert not diffs, "\n".join(diffs)


def _sdk(body: dict) -> dict:
    """The client's arguments: vLLM's own parameters go in `extra_body`, as vLLM's docs say."""
    known = {"model", "messages", "prompt", "max_tokens", "temperature", "logprobs", "top_logprobs",
             "presence_penalty", "frequency_penalty", "logit_bias", "stop", "response_format"}
    return {k: v for k, v in body.items() if k in known} | {
        "extra_body": {k: v for k, v in body.items() if k not in known}}


def _streamed(create, body: dict) -> dict:
    """A streamed response put together as a whole one: text, logprobs and usage."""
    text: list[str] = []
    content: list = []
    comp: dict[str, list] = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    reason, usage = None, None
    chat = "messages" in body
    for chunk in create(**_sdk(body), stream=True, stream_options={"include_usage": True}):
        d = chunk.model_dump(mode="json")
        usage = d.get("usage") or usage
        for c in d["choices"]:
            text.append((c["delta"].get("content") if chat else c["text"]) or "")
            reason = c["finish_reason"] or reason
            if c.get("logprobs"):
                if chat:
                    content += c["logprobs"]["content"]
                else:
                    for k in comp:
                        comp[k] += c["logprobs"][k]
    logprobs = None if body.get("logprobs") in (None, False) else (
        dict(content=content, refusal=None) if chat else comp)
    choice = dict(finish_reason=reason, logprobs=logprobs)
    choice.update(message=dict(content="".join(text))) if chat else choice.update(text="".join(text))
    return dict(choices=[choice], usage=usage)
