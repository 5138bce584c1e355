"""engine/logits.py against vLLM's own answers.

The oracle is vLLM uninterrupted: its native structured outputs and penalties over a whole
greedy run. Cut that run at k tokens and resume it through the processor, and the tokens
must be the same; resumed the naive way (vLLM's own options on the longer prompt), they
are not, which is what makes the comparison a test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from engine.logits import KEY, LOGITS_PROCESSORS, NEUTRAL, check_params, resume_params
from engine.sampling import Sampling
from engine.vllm_engine import vllm_args

pytestmark = pytest.mark.engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "eel"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
NUMBERS = {"type": "array", "items": {"type": "integer", "maximum": 999}, "minItems": 2, "maxItems": 5}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["tags", "ok"],
}
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"[a-z]{3,8}-\d{2,4}"
# The tiny model would pad JSON with whitespace up to max_tokens; a bias keeps it brief.
BRIEF = {"logit_bias": {ord(c): -100.0 for c in " \t\r\n"}}  # a byte's token id is the byte

# name: (grammar, the request's other SamplingParams)
GRAMMARS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "person": (dict(json=PERSON), BRIEF),
    "numbers": (dict(json=NUMBERS), BRIEF),
    "tags": (dict(json=TAGS), BRIEF),
    "json_object": (dict(json_object=True), BRIEF),
    "regex": (dict(regex=REGEX), {}),
    "choice": (dict(choice=CHOICES), {}),
    "person, penalised": (dict(json=PERSON), BRIEF | dict(presence_penalty=0.5, frequency_penalty=0.8)),
}
PENALTIES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.0),
    dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3),
    dict(frequency_penalty=2.0, logit_bias={101: 8.0, 32: -5.0}),
]
M = 160  # max_tokens of an uninterrupted run


@dataclass
class Out:
    tokens: list[int]
    reason: str | None
    text: str


@pytest.fixture(scope="module")
def llm(tiny_model):
    """One vLLM engine with the processor, configured as Ballast configures its engines."""
    from vllm import LLM

    args = vllm_args(tiny_model, kv_cache_gib=0.5, max_num_seqs=64)
    args.pop("enable_log_requests")  # the async engine's alone
    assert args["logits_processors"] == LOGITS_PROCESSORS
    llm = LLM(**args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def run(llm, requests: list[tuple[list[int], dict[str, Any]]]) -> list[Out]:
    """Greedy generations, all in one batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests],
                        [SamplingParams(temperature=0.0, **kw) for _, kw in requests], use_tqdm=False)
    return [Out(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


def prompt(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def cut_points(llm, tokens: list[int]) -> list[int]:
    """Where to cut a run: after its first token, inside each string (one character in),
    half way, and before its last token."""
    decode = llm.get_tokenizer().decode
    strings: dict[int, int] = {}  # quotes before it: the cut
    for k in range(1, len(tokens)):
        text = decode(tokens[:k])
        if text.count('"') % 2 and text[-1] != '"':
            strings.setdefault(text.count('"'), k)
    return sorted({1, len(tokens) // 2, len(tokens) - 1, *strings.values()} - {0, len(tokens)})


def valid(grammar: dict[str, Any], text: str) -> None:
    if "json" in grammar:
        jsonschema.validate(json.loads(text), grammar["json"])
    elif "json_object" in grammar:
        assert isinstance(json.loads(text), dict)
    elif "regex" in grammar:
        assert re.fullmatch(grammar["regex"], text)
    else:
        assert text in grammar["choice"]


@pytest.mark.parametrize("name", GRAMMARS)
def test_a_resumed_grammar_continues_as_vllms_own(llm, name):
    grammar, base = GRAMMARS[name]
    prompts = [prompt(llm, f"Request {i}: {name} as {json.dumps(grammar)}") for i in range(3)]
    full = run(llm, [(p, resume_params(base | dict(max_tokens=M), grammar)) for p in prompts])
    for f in full:
        assert f.reason == "stop", f  # a complete value, ended by EOS
        valid(grammar, f.text)
    cuts = [(p, f, k) for p, f in zip(prompts, full, strict=True) for k in cut_points(llm, f.tokens)]
    cut = run(llm, [(p, resume_params(base | dict(max_tokens=k), grammar)) for p, _, k in cuts])
    resumed = run(llm, [(p + c.tokens, resume_params(base | dict(max_tokens=M - k), grammar, c.tokens))
                        for (p, _, k), c in zip(cuts, cut, strict=True)])
    naive = run(llm, [(p + c.tokens, resume_params(base | dict(max_tokens=M - k), grammar))
                      for (p, _, k), c in zip(cuts, cut, strict=True)])
    for (_, f, k), c, r in zip(cuts, cut, resumed, strict=True):
        assert c.tokens == f.tokens[:k] and c.reason == "length"
        assert (c.tokens + r.tokens, r.reason) == (f.tokens, f.reason), k
    assert any(c.tokens + n.tokens != f.tokens for (_, f, _), c, n in zip(cuts, cut, naive, strict=True))


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(p))
def test_resumed_penalties_are_the_uninterrupted_runs(llm, penalties):
    base = dict(penalties, ignore_eos=True)
    n, ks = 48, (1, 16, 40)
    prompts = [prompt(llm, f"Request {i}: once upon a time") for i in range(4)]
    full = run(llm, [(p, base | dict(max_tokens=n)) for p in prompts])
    plain = run(llm, [(p, dict(max_tokens=n, ignore_eos=True)) for p in prompts])
    assert any(f.tokens != q.tokens for f, q in zip(full, plain, strict=True))  # they matter here
    cuts = [(p, f, k) for p, f in zip(prompts, full, strict=True) for k in ks]
    cut = run(llm, [(p, base | dict(max_tokens=k)) for p, _, k in cuts])
    resumed = run(llm, [(p + c.tokens, resume_params(base | dict(max_tokens=n - k), None, c.tokens))
                        for (p, _, k), c in zip(cuts, cut, strict=True)])
    naive = run(llm, [(p + c.tokens, base | dict(max_tokens=n - k)) for (p, _, k), c in zip(cuts, cut, strict=True)])
    for (_, f, k), c, r in zip(cuts, cut, resumed, strict=True):
        assert c.tokens == f.tokens[:k]
        assert c.tokens + r.tokens == f.tokens, k
    assert any(c.tokens + v.tokens != f.tokens for (_, f, _), c, v in zip(cuts, cut, naive, strict=True))


def test_repetition_penalty_alone_survives_a_resume_natively(llm):
    base = dict(repetition_penalty=1.5, ignore_eos=True)
    p = prompt(llm, "Request 1: once upon a time")
    [full, cut] = run(llm, [(p, base | dict(max_tokens=48)), (p, base | dict(max_tokens=16))])
    params = resume_params(base | dict(max_tokens=32), None, cut.tokens)
    assert params == base | dict(max_tokens=32)  # no processor: prompt | output is what it was
    [rest] = run(llm, [(p + cut.tokens, params)])
    assert cut.tokens + rest.tokens == full.tokens


async def test_requests_without_extra_args_are_unaffected(llm, engine):
    """Plain requests, batched with the processor's, as on an engine where the processor
    has nothing to do (no request of its own: it returns at once)."""
    prompts = [prompt(llm, f"Request {i}: plain") for i in range(4)]
    start = '{"name":"ab'
    produced = prompt(llm, start)[1:]  # without BOS
    busy = (prompt(llm, "Request 9: busy") + produced,
            resume_params(BRIEF | dict(max_tokens=48, frequency_penalty=1.0), dict(json=PERSON), produced))
    outs = run(llm, [(p, dict(max_tokens=48)) for p in prompts] + [busy, busy])
    for o in outs[-2:]:  # its grammar went on from inside the string
        valid(dict(json=PERSON), start + o.text)
    for p, o in zip(prompts, outs, strict=False):
        assert (o.tokens, o.reason) == await alone(engine, p, 48)


async def alone(engine, p: list[int], n: int) -> tuple[list[int], str | None]:
    """A greedy run on Ballast's own engine, alone: its processor has no request to act on."""
    tokens: list[int] = []
    reason = None
    async for step in engine.generate(uuid.uuid4().hex, p, Sampling(n, temperature=0.0)):
        tokens += step.token_ids
        reason = step.finish_reason
    return tokens, reason


def test_requests_the_processor_cannot_honour_are_refused(llm):
    from vllm.exceptions import VLLMValidationError

    p = prompt(llm, "Request 0")
    ours = resume_params(dict(max_tokens=8, frequency_penalty=1.0), dict(json=PERSON), p[-2:])
    for bad in [
        ours | dict(frequency_penalty=1.0),  # twice penalised
        ours | dict(min_tokens=2),
        ours | dict(extra_args={KEY: {"grammar": dict(json={"type": "string", "format": "no-such"})}}),
        ours | dict(extra_args={KEY: {"resumed": -1}}),
        ours | dict(extra_args={KEY: {"penalties": dict(presence_penalty=9.0)}}),
        ours | dict(extra_args={KEY: {"whatever": 1}}),
        ours | dict(extra_args={KEY: {"grammar": {"jsn": {}}}}),
    ]:
        with pytest.raises(VLLMValidationError):  # a 400, as vLLM's own checks give
            run(llm, [(p, bad)])
    assert run(llm, [(p, ours)])[0].tokens  # the engine lives on


def test_resume_params():
    base = dict(max_tokens=10, presence_penalty=0.5, repetition_penalty=1.2, extra_args={"mine": 1})
    fresh = resume_params(base, dict(regex="a+"))
    assert fresh["structured_outputs"].regex == "a+" and fresh["extra_args"] == {"mine": 1}
    assert fresh["presence_penalty"] == 0.5
    resumed = resume_params(base, dict(regex="a+"), [1, 2, 3])
    assert "structured_outputs" not in resumed and resumed | NEUTRAL == resumed
    assert resumed["extra_args"] == {"mine": 1, KEY: dict(grammar=dict(regex="a+"), resumed=3, penalties=dict(
        presence_penalty=0.5, frequency_penalty=0.0, repetition_penalty=1.2))}
    assert resume_params(dict(max_tokens=10), None, [1, 2]) == dict(max_tokens=10)
    assert base == dict(max_tokens=10, presence_penalty=0.5, repetition_penalty=1.2, extra_args={"mine": 1})

    from vllm import SamplingParams

    check_params(SamplingParams(**resumed))
    check_params(SamplingParams(max_tokens=3))


def test_importing_it_imports_no_vllm():
    code = "import engine.logits, sys; assert not {'vllm', 'torch'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
