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

# Tools, read by vLLM's hermes parser (the tiny model's template writes Hermes' markers).
# Strict tools' arguments follow their schemas; a lax one's may be any JSON.
WEATHER = dict(type="function", function=dict(name="get_weather", description="The forecast", strict=True, parameters={
    "type": "object", "required": ["city", "days"], "additionalProperties": False, "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}))
CLOCK = dict(type="function", function=dict(name="get_time", strict=True, parameters={
    "type": "object", "required": ["zone"], "additionalProperties": False, "properties": {
        "zone": {"enum": ["UTC", "CET"]}}}))
LAX = dict(type="function", function=dict(name="note", parameters={"type": "object"}))
TOOLS = [WEATHER, CLOCK]
HISTORY = [dict(role="user", content="Weather in Oslo?"),
           dict(role="assistant", content=None, tool_calls=[dict(id="call_1", type="function", function=dict(
               name="get_weather", arguments='{"city": "Oslo", "days": 2}'))]),
           dict(role="tool", tool_call_id="call_1",
                content=[dict(type="text", text="sun"), dict(type="text", text="5C")]),
           dict(role="user", content="And the time?")]
TOOL_LINES = [
    chat("t-named", "Weather in Oslo?", 96, logit_bias=BRIEF, tools=TOOLS,
         tool_choice=dict(type="function", function=dict(name="get_weather"))),
    chat("t-required-one", "What now?", 96, logit_bias=BRIEF, tools=TOOLS, tool_choice="required",
         parallel_tool_calls=False, logprobs=True, top_logprobs=1),
    chat("t-required", "Both, please", 48, logit_bias=BRIEF, tools=TOOLS, tool_choice="required"),
    chat("t-auto", "Weather in Oslo?", 24, tools=TOOLS),
    chat("t-none", "Weather in Oslo?", 24, tools=TOOLS, tool_choice="none"),
    chat("t-lax", "Take a note", 24, logit_bias=BRIEF, tools=[LAX], tool_choice="required"),
    dict(chat("t-history", "", 96), body=dict(chat("x", "", 96, logit_bias=BRIEF, tools=TOOLS, tool_choice=dict(
        type="function", function=dict(name="get_time")))["body"], messages=HISTORY)),
]

def sampled(line: dict, **over) -> dict:
    """The line with its body's sampling changed (temperature, seed, …)."""
    return dict(line, body=dict(line["body"], **over))


# Several choices, each choice i sampled with seed + i (vLLM's parallel sampling): seeded
# ones differ; with top_k 1 each is greedy's text (so a preempted one can be held to
# vLLM's), which vLLM serves where it refuses n > 1 at temperature 0 (as Ballast does).
CHOICE_LINES = [
    sampled(chat("n-top1", "Tell me a story.", 12, n=2), temperature=1.0, top_k=1),
    sampled(chat("n-required", "What now?", 96, logit_bias=BRIEF, tools=TOOLS, tool_choice="required", n=2),
            temperature=1.0, top_k=1),
    sampled(chat("n-seeded", "Zürich in winter", 10, n=3), temperature=1.0, seed=7),
    chat("n-greedy", "Tell me a story.", 12, n=2),  # refused by both
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
    *TOOL_LINES,
    *CHOICE_LINES,
]
SAMPLING_COMPLETIONS = [
    completion("q-logprobs", "Once upon a time", 9, logprobs=3),
    completion("q-logprobs-0", "日本語テキスト", 11, logprobs=0),
    completion("q-logprobs-20", "🚀 launch", 6, logprobs=20),
    completion("q-penalties", "x = 1\n", 20, presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.3),
    completion("q-min-tokens-stop", "Zürich", 30, min_tokens=12, stop=["M"]),
    completion("q-stop-ids-logprobs", "Once upon a time", 30, stop_token_ids=[32], logprobs=2),
    # echo: the prompt's text and (vLLM's prompt logprobs) its tokens' logprobs first;
    # max_tokens 0, the prompt alone (what evaluation harnesses score a text with).
    completion("e-echo", "Once upon a time", 8, echo=True),
    completion("e-echo-logprobs", "Zürich in winter", 6, echo=True, logprobs=2),
    completion("e-echo-only", "Once upon a time", 0, echo=True, logprobs=1),
    completion("e-echo-ids", [256, 104, 195, 169, 108, 108, 111, 32], 5, echo=True, logprobs=0),
    sampled(completion("n-seeded-logprobs", "Once upon a time", 8, n=2, logprobs=2), temperature=1.0, seed=3),
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

        async def stream(line):  # vLLM's own stream of a chat line: its server-sent events, as sent
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            body = dict(line["body"], stream=True, stream_options={"include_usage": True})
            events = await state.openai_serving_chat.create_chat_completion(ChatCompletionRequest.model_validate(body))
            return dict(custom_id=line["custom_id"], events=[e async for e in events])

        async def streams():
            lines = [json.loads(ln) for ln in open(os.environ["ORACLE_STREAMS_IN"]) if ln.strip()]
            outs = await asyncio.gather(*map(stream, lines))
            with open(os.environ["ORACLE_STREAMS_OUT"], "w") as f:
                f.writelines(json.dumps(o) + "\n" for o in outs)

        await asyncio.gather(rb.run_batch(client, args), completions(), streams())


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
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
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
        self.streams_in, self.streams_out = root / "streams.jsonl", root / "streams.out.jsonl"
        self.streams_in.write_text(_jsonl([ln for ln in CHAT_LINES if ln["custom_id"] in STREAMED]))
        (root / "driver.py").write_text(DRIVER)
        self.log = root / "vllm.log"
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1", ORACLE_COMPLETIONS_IN=str(self.comp_in),
                   ORACLE_COMPLETIONS_OUT=str(self.comp_out), ORACLE_STREAMS_IN=str(self.streams_in),
                   ORACLE_STREAMS_OUT=str(self.streams_out))
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

    def streams(self) -> dict[str, dict]:
        """vLLM's streams of the STREAMED lines, each put together as a whole response."""
        self.results()
        out = {}
        for ln in self.streams_out.read_text().splitlines():
            line = json.loads(ln)
            chunks = [json.loads(e.removeprefix("data: ")) for e in "".join(line["events"]).split("\n\n")
                      if e.startswith("data: {")]
            out[line["custom_id"]] = dict(response=dict(status_code=200, body=_merged(chunks, chat=True)))
        return out

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
    # The stack's engine serves fine-tuned models (LoRA), where vLLM's prompt logprobs kill
    # the engine core: Ballast refuses an echo with logprobs there (test_echo_logprobs_*
    # holds them to vLLM's on an engine without LoRA).
    **{cid: [f"{cid}: status 400 (Ballast) vs 200 (vLLM)"] for cid in ("e-echo-logprobs", "e-echo-only", "e-echo-ids")},
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


def valid_calls(bodies: dict[str, dict]) -> None:
    """The forced tool calls are calls of the tools asked for, each call's arguments valid
    against its tool's schema by a validator that is not the engine's."""
    import jsonschema_rs

    lines = {ln["custom_id"]: ln["body"] for ln in TOOL_LINES}
    for cid in ("t-named", "t-required-one", "t-history"):
        calls = bodies[cid]["choices"][0]["message"]["tool_calls"]
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in lines[cid]["tools"]}
        choice = lines[cid]["tool_choice"]
        assert len(calls) == 1, (cid, calls)
        for call in calls:
            assert call["function"]["name"] == (choice["function"]["name"] if isinstance(choice, dict)
                                                else call["function"]["name"]) and call["function"]["name"] in tools
            jsonschema_rs.validate(tools[call["function"]["name"]], json.loads(call["function"]["arguments"]))


def tokens_of(body: dict) -> int:
    return body["usage"]["completion_tokens"]


def _text(endpoint_body: dict, index: int = 0) -> str | None:
    c = endpoint_body["choices"][index]
    return c["message"]["content"] if "message" in c else c["text"]


def _calls(endpoint_body: dict, index: int = 0) -> list[tuple] | None:
    """A chat choice's tool calls, each call's id aside (vLLM's are random, as OpenAI's)."""
    c = endpoint_body["choices"][index]
    if "message" not in c:
        return None
    return [(t["type"], t["function"]["name"], t["function"]["arguments"], bool(t["id"]))
            for t in c["message"].get("tool_calls") or []]


def compare(custom_id: str, ours: dict, theirs: dict) -> list[str]:
    """What differs between Ballast's line and vLLM's, as messages; [] when they agree."""
    ours_status, theirs_status = ours["response"]["status_code"], theirs["response"]["status_code"]
    if theirs_status != 200 or ours_status != 200:
        if ours_status // 100 == theirs_status // 100 == 4:
            return []
        return [f"{custom_id}: status {ours_status} (Ballast) vs {theirs_status} (vLLM)"]
    a, b = ours["response"]["body"], theirs["response"]["body"]
    if [c["index"] for c in a["choices"]] != [c["index"] for c in b["choices"]]:
        return [f"{custom_id}: choices {len(a['choices'])} (Ballast) vs {len(b['choices'])} (vLLM)"]
    diffs = []
    for what, x, y in [
        *[(f"usage.{k}", a["usage"][k], b["usage"][k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens")],
        *[item for i in range(len(a["choices"])) for item in [
            (f"choices[{i}].text", _text(a, i), _text(b, i)),
            (f"choices[{i}].tool_calls", _calls(a, i), _calls(b, i)),
            (f"choices[{i}].finish_reason", a["choices"][i]["finish_reason"], b["choices"][i]["finish_reason"])]],
    ]:
        if x != y:
            diffs.append(f"{custom_id}: {what} {x!r} (Ballast) vs {y!r} (vLLM)")
    for i, (x, y) in enumerate(zip(a["choices"], b["choices"], strict=True)):
        if not close(x["logprobs"], y["logprobs"]):
            diffs.append(f"{custom_id}: choices[{i}].logprobs {json.dumps(x['logprobs'])[:400]} (Ballast) vs "
                         f"{json.dumps(y['logprobs'])[:400]} (vLLM)")
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
                                        AND NOT k.payload ? 'choice'  -- the first choice's
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
        "c-too-long", "c-no-model", "p-too-long", "p-no-model", "s-bias-oov", "n-greedy"}
    # The sampling lines do what they say on vLLM's side (else equal outputs would prove little).
    body = {c: theirs[c]["response"]["body"] for c in ids if theirs[c]["response"]["status_code"] == 200}
    assert len(body["s-logprobs"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5
    assert len(body["q-logprobs-20"]["choices"][0]["logprobs"]["top_logprobs"][0]) > 10  # by text: some collide
    assert body["s-min-tokens"]["usage"]["completion_tokens"] >= 20 > tokens_of(body["c-eos"])
    assert body["s-stop-ids"]["choices"][0]["finish_reason"] == "stop"
    assert _text(body["e-echo-only"]) == "Once upon a time" and _text(body["e-echo"]).startswith("Once upon a time")
    assert body["e-echo-only"]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # BOS: nothing before it
    assert _text(body["s-stop-incl"]).endswith("\u00ef")
    valid_structured(body)
    valid_calls(body)
    assert body["t-required-one"]["choices"][0]["finish_reason"] == "tool_calls"
    assert body["t-named"]["choices"][0]["finish_reason"] == "stop"  # OpenAI's, for a named function
    assert not _calls(body["t-auto"]) and not _calls(body["t-none"]) and not _calls(body["t-lax"])
    # Several choices: top_k 1, the greedy text n times; seeded, each its own sample.
    assert _text(body["n-top1"], 0) == _text(body["n-top1"], 1) == _text(body["c-mid-2"])
    assert all(body["n-required"]["choices"][i]["finish_reason"] == "tool_calls" for i in (0, 1))
    assert len({_text(body["n-seeded"], i) for i in range(3)}) == 3
    assert len({_text(body["n-seeded-logprobs"], i) for i in range(2)}) == 2
    for plain, varied in (("c-stop", "s-presence"), ("c-stop", "s-repetition"), ("c-clean-1", "s-logit-bias"),
                          ("c-stop", "s-frequency")):
        assert _text(body[plain])[:20] != _text(body[varied])[:20], (plain, varied)
    assert theirs["c-stop"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert theirs["p-stop"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert not unexpected, "\n".join(x for d in unexpected.values() for x in d)
    assert equal == len(ids) - len(KNOWN)


# Lines whose streamed answer is held to vLLM's own stream, not to its whole answer: a tool
# parser streams the arguments as the model wrote them, where the whole answer has them
# re-serialized, and holds back a call it cannot yet read.
STREAMED = ["t-named", "t-required-one", "t-auto", "t-history", "t-lax", "n-required"]
INTERACTIVE = ["s-logprobs", "s-logprobs-eos", "s-frequency", "s-stop-ids", "s-specials", "q-logprobs",
               "q-stop-ids-logprobs", "q-penalties", "j-person", "j-regex", "t-named", "t-required-one", "t-auto",
               "t-history", "t-lax", "e-echo", "n-top1", "n-required", "n-seeded", "n-seeded-logprobs"]


async def test_interactive_equals_vllms_own(vllm_run, stack, client):
    """The same bodies through the official client, whole and streamed, against vLLM's
    answers to the batch lines (and, for STREAMED, against vLLM's own streams)."""
    theirs = await asyncio.to_thread(vllm_run.results)
    their_streams = await asyncio.to_thread(vllm_run.streams)
    lines = {ln["custom_id"]: ln for ln in CHAT_LINES + COMPLETION_LINES}
    diffs = []
    for cid in INTERACTIVE:
        line, want = lines[cid], theirs[cid]
        create = client.chat.completions.create if line["url"] == CHAT else client.completions.create
        whole = (await asyncio.to_thread(create, **_sdk(line["body"]))).model_dump(mode="json")
        diffs += compare(cid, dict(response=dict(status_code=200, body=whole)), want)
        streamed = await asyncio.to_thread(_streamed, create, line["body"])
        diffs += compare(f"{cid} (streamed)", dict(response=dict(status_code=200, body=streamed)),
                         their_streams.get(cid, want))
    assert not diffs, "\n".join(diffs)


def _sdk(body: dict) -> dict:
    """The client's arguments: vLLM's own parameters go in `extra_body`, as vLLM's docs say."""
    known = {"model", "messages", "prompt", "max_tokens", "temperature", "logprobs", "top_logprobs", "echo",
             "presence_penalty", "frequency_penalty", "logit_bias", "stop", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "n", "seed"}
    return {k: v for k, v in body.items() if k in known} | {
        "extra_body": {k: v for k, v in body.items() if k not in known}}


def _streamed(create, body: dict) -> dict:
    """A streamed response put together as a whole one."""
    chunks = [c.model_dump(mode="json") for c in create(**_sdk(body), stream=True,
                                                        stream_options={"include_usage": True})]
    return _merged(chunks, chat="messages" in body, logprobs=body.get("logprobs") not in (None, False))


def _merged(chunks: list[dict], chat: bool, logprobs: bool | None = None) -> dict:
    """Chunks as one response: each choice's text, tool calls (their pieces joined by index,
    as the SDK's accumulators do), finish reason and logprobs, by the choice's index; and
    the usage."""
    by: dict[int, dict] = {}
    usage = None
    for d in chunks:
        usage = d.get("usage") or usage
        for c in d["choices"]:
            one = by.setdefault(c["index"], dict(text=[], calls={}, content=[], reason=None, comp=dict(
                tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])))
            one["text"].append((c["delta"].get("content") if chat else c["text"]) or "")
            for piece in (c["delta"].get("tool_calls") or []) if chat else []:
                call = one["calls"].setdefault(piece["index"], dict(id="", type="function",
                                                                    function=dict(name="", arguments="")))
                call["id"] += piece.get("id") or ""
                call["function"]["name"] += (piece.get("function") or {}).get("name") or ""
                call["function"]["arguments"] += (piece.get("function") or {}).get("arguments") or ""
            one["reason"] = c["finish_reason"] or one["reason"]
            if c.get("logprobs"):
                if chat:
                    one["content"] += c["logprobs"]["content"]
                else:
                    for k in one["comp"]:
                        one["comp"][k] += c["logprobs"][k]
    choices = []
    for index in sorted(by):
        one = by[index]
        shown = logprobs if logprobs is not None else bool(one["content"] or one["comp"]["tokens"])
        choice = dict(index=index, finish_reason=one["reason"], logprobs=(
            dict(content=one["content"], refusal=None) if chat else one["comp"]) if shown else None)
        if chat:
            choice.update(message=dict(content="".join(one["text"]),
                                       tool_calls=[one["calls"][i] for i in sorted(one["calls"])]))
        else:
            choice.update(text="".join(one["text"]))
        choices.append(choice)
    return dict(choices=choices, usage=usage)


async def test_echo_logprobs_equal_vllms_own(vllm_run, engine):
    """On an engine without LoRA (the stack's serves fine-tuned models, where Ballast refuses
    it): an echo with logprobs, its prompt logprobs taken in the generating request (as an
    interactive request takes them) and in a request of their own (as a batch item does),
    equals vLLM's completions handler's answer: text, usage and logprobs."""
    from engine import sampling
    from protocol import responses
    from protocol.errors import ProtocolError
    from protocol.requests import COMPLETIONS, RequestLimits, parse

    theirs = await asyncio.to_thread(vllm_run.results)
    diffs, lines = [], [ln for ln in COMPLETION_LINES if ln["custom_id"].startswith("e-")]
    for line in lines:
        cid = line["custom_id"]
        req = parse(COMPLETIONS, line["body"], RequestLimits(MODEL, 1024))
        ready = sampling.prepare(engine, req)
        assert not isinstance(req, ProtocolError) and not isinstance(ready, ProtocolError), (req, ready)
        tokens: list[int] = []
        alternatives: list = []
        in_request, reason = None, None
        async for step in engine.generate(f"echo-{cid}", ready.prompt, ready.sampling):
            tokens += step.token_ids
            alternatives += step.logprobs or []
            in_request, reason = in_request or step.prompt_logprobs, step.finish_reason
        own = (await sampling.prompt_logprobs(engine, f"echo-own-{cid}", ready.prompt, ready.sampling)
               if req.logprobs is not None else None)
        text, reason, used = sampling.finish(engine, ready.prompt, tokens, ready.sampling, reason)
        shown = sampling.echo_text(engine, req, ready.prompt) + (text if req.max_tokens != 0 else "")
        for how, echoed in (("in the request", in_request), ("on their own", own)):
            choice = responses.Choice(shown, reason, sampling.logprobs(engine, req, tokens[:used], alternatives[:used],
                                                                       echoed))
            body = responses.completion(COMPLETIONS, {}, [choice], len(ready.prompt), used)
            diffs += compare(f"{cid} ({how})", dict(response=dict(status_code=200, body=body)), theirs[cid])
    assert len(lines) == 4 and not diffs, "\n".join(diffs)
