"""OpenAI's published OpenAPI description is the generator of valid requests: every body it
accepts, explicit nulls for nullable fields included, is served, or refused with a 4xx for
a reason listed here, never for spelling a default.

The request bodies of chat, completions, embeddings and batches come from
tests/protocol/openai/openapi-subset.json (trimmed from OpenAI's spec; its README says how
to refresh it), read as OpenAI's own generators read them:

- `nullable: true` (an OpenAPI 3.0 keyword the 3.1 document still uses) admits null;
- an `allOf` of objects is one object, a property declared twice taking its last
  declaration (`top_logprobs` is declared three times, nullable only in the last);
- an object that names its properties takes no others: OpenAI answers an unknown one with
  "Unrecognized request argument", so a body with made-up keys is not one it accepts.

The served model's name stands in for `model` (any other is a 404, which no schema can
say), and an uploaded file's id for a batch's `input_file_id`.

What a body may be refused for: an endpoint or a parameter in `DELIBERATE_REFUSALS` (the
one list of what Ballast does not offer), or a rule in `BEYOND_THE_SCHEMA`, which the
schema cannot state and OpenAI's API enforces too (or which is Ballast's own stated
limit), each with the test that the body really breaks it.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema_rs
import pydantic
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation.jsonschema.builder import build
from schemathesis.generation.jsonschema.context import Alphabet

from api.batches import CreateBatch, create
from api.errors import APIError
from config import Settings
from protocol import embeddings
from protocol.embeddings import EmbeddingRequest
from protocol.errors import ProtocolError, bad_char
from protocol.requests import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    INT64,
    MAX_STOP_CHARS,
    TOOLS_CONFLICT,
    GenerationRequest,
    RequestLimits,
    parse,
)

SUBSET = Path(__file__).with_name("openai") / "openapi-subset.json"
SPEC = json.loads(SUBSET.read_text())
MODEL = "ballast-tiny"
MAX_MODEL_LEN = 4096
LIMITS = RequestLimits(MODEL, MAX_MODEL_LEN)
FILE_ID = "file-0123456789abcdef01234567"
BATCHES = "/v1/batches"

# What Ballast deliberately does not offer, and why: an endpoint (its path), or a parameter
# (its path in the body, `[]` standing for any index) refused with a 4xx whose `param` names
# it or something inside it, with one of DELIBERATE_CODES (a client must not read a refusal
# of what it was entitled to send as a mistake of its own). The API reference's list of what
# is not offered is to be written from this one.
DELIBERATE_REFUSALS: dict[str, str] = {
    "/v1/responses": "The Responses API (server-side conversation state, built-in tools) is not offered.",
    "/v1/moderations": "No moderation models.",
    "/v1/images/generations": "No image models.",
    "/v1/images/edits": "No image models.",
    "/v1/videos": "No video models.",
    "modalities": "Text output only: anything but [\"text\"] asks for audio.",
    "audio": "Text output only: no audio.",
    "messages[].audio": "An earlier audio answer: there are none to refer to.",
    "messages[].content[].image_url": "Text input only: the served models take no images.",
    "messages[].content[].input_audio": "Text input only: the served models take no audio.",
    "messages[].content[].file": "Text input only: no files in messages.",
    "tools": "Custom tools (type `custom`, free-form input): function tools are served.",
    "tool_choice": "`allowed_tools` and custom tool choices: none, auto, required and one function are served.",
    "functions": "Deprecated function calling: its successor, tools, is served.",
    "function_call": "Deprecated function calling (`none` and `auto` are served: they ask for none).",
    "messages[].tool_calls": "Custom tool calls: function tool calls are served.",
    "messages[].function_call": "Deprecated function calling: its successor, tools, is served.",
    "messages[].role": "Function results (role `function`, the deprecated form of tool results; `tool` results "
                       "are served).",
    "prediction": "No predicted outputs.",
    "web_search_options": "No web search.",
    "moderation": "No moderation of inputs or outputs.",
    "store": "No stored completions (true): nothing is kept for evals or distillation.",
    "reasoning_effort": "The served model's reasoning is its own, not set per request (beyond the default).",
    "verbosity": "The served model's verbosity is its own, not set per request (beyond the default).",
    "prompt_cache_options": "vLLM's prefix cache is automatic and evicted under pressure: no TTL can be promised.",
    "prompt_cache_retention": "vLLM's prefix cache is automatic and evicted under pressure: no retention can be "
                              "promised.",
    "service_tier": "OpenAI's own capacity products (`scale`, `fast`): Ballast's tiers are auto, priority, default "
                    "and flex.",
    "max_tokens": "0 without echo (nothing generated, nothing shown): with echo, the prompt alone is served.",
    "max_completion_tokens": "0 (nothing generated): vLLM generates at least one token.",
    "prompt": "One prompt per request (or a list holding one): several are a batch, for /v1/batches.",
    "n": "n > 1 with greedy sampling (temperature or top_p 0): n copies of one text, which vLLM refuses too.",
    "response_format": "Types other than text, json_object and json_schema (which are served).",
    "best_of": "vLLM's V1 engine has no best_of (1, the default, is served).",
    "suffix": "vLLM has no insertion (suffix); null, the default, is served.",
}
DELIBERATE_CODES = frozenset({"unsupported_parameter", "unsupported_value"})


@dataclass(frozen=True)
class Unstated:
    """A refusal of a body the schema accepts, for a rule it cannot state: `param` (None:
    any) and `code` as `parse` answers, and whether `body` really breaks the rule."""

    param: str | None
    code: str
    why: str
    broken: Callable[[str, dict[str, Any]], bool]


def _int_out_of(lo: float, hi: float, name: str) -> Callable[[str, dict[str, Any]], bool]:
    return lambda endpoint, body: isinstance(body.get(name), (int, float)) and not lo <= body[name] <= hi


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _texts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _texts(v)


def _ints(value: Any) -> Iterator[Any]:
    if isinstance(value, list):
        for v in value:
            yield from _ints(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def _metadata_too_big(endpoint: str, body: dict[str, Any]) -> bool:
    m = body.get("metadata")
    return isinstance(m, dict) and (len(m) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in m.items()))


def _bias_off(endpoint: str, body: dict[str, Any]) -> bool:
    bias = body.get("logit_bias") or {}
    return any(not re.fullmatch(r"[0-9]+", k) or not -100 <= v <= 100 for k, v in bias.items())


def _stop_too_long(endpoint: str, body: dict[str, Any]) -> bool:
    stop = body.get("stop")
    return any(len(s) > MAX_STOP_CHARS for s in ([stop] if isinstance(stop, str) else stop or []))


def _tool_names(body: dict[str, Any]) -> list[str]:
    tools = body.get("tools") or []
    return [t["function"]["name"] for t in tools if isinstance(t, dict) and t.get("type") == "function"]


def _unknown_tool(body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and (choice.get("function") or {}).get("name") not in _tool_names(body)


BEYOND_THE_SCHEMA: tuple[Unstated, ...] = (
    Unstated("model", "model_not_found", "The model must be one the deployment serves (a 404).",
             lambda endpoint, body: body.get("model") != MODEL),
    Unstated("max_tokens", "context_length_exceeded", "The completion must fit the model's context.",
             _int_out_of(-math.inf, MAX_MODEL_LEN, "max_tokens")),
    Unstated("max_completion_tokens", "context_length_exceeded", "The completion must fit the model's context.",
             _int_out_of(-math.inf, MAX_MODEL_LEN, "max_completion_tokens")),
    Unstated("max_tokens", "invalid_value", "Chat's schema gives no minimum; OpenAI refuses fewer than 1 token.",
             lambda endpoint, body: endpoint == CHAT and _int_out_of(1, math.inf, "max_tokens")(endpoint, body)),
    Unstated("max_completion_tokens", "invalid_value", "No minimum in the schema; OpenAI refuses fewer than 1 token.",
             _int_out_of(1, math.inf, "max_completion_tokens")),
    Unstated("seed", "invalid_value", "A seed is an int64: chat's schema bounds it by int64's ends as doubles round "
             "them (±9223372036854776000, just outside), completions' by `format: int64`.",
             _int_out_of(*INT64, "seed")),
    Unstated("prompt", "invalid_value", "Token ids index the vocabulary: none is negative.",
             lambda endpoint, body: any(t < 0 for t in _ints(body.get("prompt")))),
    Unstated("input", "invalid_value", "CreateEmbeddingRequest.input's description: it cannot be an empty string; "
             "and token ids index the vocabulary, none negative.",
             lambda endpoint, body: endpoint == EMBEDDINGS and (
                 any(t == "" for t in _texts(body.get("input"))) or any(t < 0 for t in _ints(body.get("input"))))),
    Unstated("top_logprobs", "invalid_value", "OpenAI: `logprobs` must be true when `top_logprobs` is used.",
             lambda endpoint, body: body.get("top_logprobs") not in (None, 0) and body.get("logprobs") is not True),
    Unstated("stream_options", "invalid_value", "OpenAI: `stream_options` only with `stream`: true.",
             lambda endpoint, body: body.get("stream_options") is not None and body.get("stream") is not True),
    Unstated("metadata", "invalid_value", "Metadata's description: at most 16 pairs, keys of at most 64 characters, "
             "values of at most 512.", _metadata_too_big),
    Unstated("logit_bias", "invalid_value", "logit_bias's description: token ids to biases from -100 to 100.",
             _bias_off),
    Unstated("stop", "invalid_value", f"Ballast's limit: stop strings of at most {MAX_STOP_CHARS} characters, each "
             "searched for in the whole text at every step.", _stop_too_long),
    Unstated(None, "invalid_value", "FunctionObject.name's description: 1 to 64 of a-z, A-Z, 0-9, _ and -.",
             lambda endpoint, body: any(not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", n) for n in _tool_names(body))),
    Unstated("tools", TOOLS_CONFLICT, "Two tools of one name: a call could not say which it is.",
             lambda endpoint, body: len(set(_tool_names(body))) < len(_tool_names(body))),
    Unstated("tool_choice", TOOLS_CONFLICT, "A tool must be given to be required or named, and a named one must "
             "be among them (OpenAI and vLLM refuse both); a forced call is not also structured output (vLLM "
             "refuses a named one so; its parser constrains a forced call itself).",
             lambda endpoint, body: _unknown_tool(body) or (
                 body.get("tool_choice") == "required" and not body.get("tools")) or (
                 body.get("tool_choice") not in (None, "none", "auto") and (body.get("response_format") or {}).get(
                     "type") in ("json_object", "json_schema"))),
    # The generated text holds neither (see ALPHABET); a client's may, and Postgres cannot keep them.
    Unstated(None, "unsupported_character", "NUL and lone surrogates cannot be stored.",
             lambda endpoint, body: any(bad_char(t) for t in _texts(body))),
)


# -- the spec, read as OpenAI's generators read it --------------------------------------

NULL = {"type": "null"}
_ANNOTATIONS = {"description", "title", "example", "examples", "deprecated", "discriminator"}


def _inline(node: Any, schemas: dict[str, Any], within: tuple[str, ...] = ()) -> Any:
    if isinstance(node, list):
        return [_inline(v, schemas, within) for v in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].removeprefix("#/components/schemas/")
        assert name not in within, f"a cycle through {name}: it cannot be inlined"
        return _inline(schemas[name], schemas, (*within, name))
    return {k: (v if k in ("enum", "const", "default") else _inline(v, schemas, within)) for k, v in node.items()}


def _is_object(node: Any) -> bool:
    return isinstance(node, dict) and (node.get("type") == "object" or "properties" in node)


def _keyword(name: str, value: Any) -> Any:
    if name in ("enum", "const", "default"):
        return value
    if name == "properties":  # names, not keywords: `description` is one of FunctionObject's
        return {k: _read(v) for k, v in value.items()}
    return _read(value)


def _read(node: Any) -> Any:
    if isinstance(node, list):
        return [_read(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _keyword(k, v) for k, v in node.items() if k not in _ANNOTATIONS and not k.startswith("x-")}
    if "allOf" in node and all(_is_object(b) for b in node["allOf"]):
        merged: dict[str, Any] = {"type": "object", "properties": {}}
        required: list[str] = []
        for branch in [*node.pop("allOf"), node]:
            merged["properties"].update(branch.get("properties", {}))
            required += [r for r in branch.get("required", []) if r not in required]
            merged |= {k: v for k, v in branch.items() if k not in ("properties", "required", "additionalProperties")}
        node = merged | ({"required": required} if required else {})
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    if node.pop("nullable", False):
        outer = {k: node.pop(k) for k in ("default",) if k in node}
        node = {"anyOf": [node, NULL], **outer}
    return node


def _body_schema(operation: str) -> dict[str, Any]:
    ref = SPEC["operations"][operation]["schema"]
    schema = _read(_inline(ref, SPEC["components"]["schemas"]))
    fixed = {"model": MODEL} if operation != "createBatch" else {"input_file_id": FILE_ID}
    for name, value in fixed.items():
        schema["properties"][name] = {"const": value}
    return schema


OPERATIONS = {op: "/v1" + SPEC["operations"][op]["path"] for op in SPEC["operations"]}
SCHEMAS = {OPERATIONS[op]: _body_schema(op) for op in OPERATIONS}
VALIDATORS = {endpoint: jsonschema_rs.Draft202012Validator(s) for endpoint, s in SCHEMAS.items()}
SERVED = (CHAT, COMPLETIONS, EMBEDDINGS, BATCHES)
SHORT = {CHAT: "chat", COMPLETIONS: "completions", EMBEDDINGS: "embeddings", BATCHES: "batches"}
MINIMAL: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]},
    COMPLETIONS: {"model": MODEL, "prompt": "Hello"},
    EMBEDDINGS: {"model": MODEL, "input": "Hello"},
    BATCHES: {"input_file_id": FILE_ID, "endpoint": CHAT, "completion_window": "24h"},
}


def declared_default(schema: dict[str, Any]) -> tuple[bool, Any]:
    """Whether the parameter declares a default, and which: its own, or that of the one
    branch that is not null."""
    if "default" in schema:
        return True, schema["default"]
    branches = [b for b in schema.get("anyOf", schema.get("oneOf", [])) if b != NULL]
    return declared_default(branches[0]) if len(branches) == 1 else (False, None)


_validators: dict[int, tuple[dict[str, Any], jsonschema_rs.Draft202012Validator]] = {}


def admits(schema: dict[str, Any], value: Any) -> bool:
    # Keyed by identity, the schema kept alive beside its validator so that no id is reused.
    if id(schema) not in _validators:
        _validators[id(schema)] = (schema, jsonschema_rs.Draft202012Validator(schema))
    return _validators[id(schema)][1].is_valid(value)


# -- generation ------------------------------------------------------------------------

# NUL is refused wherever it is (BEYOND_THE_SCHEMA): drawn, it would hide what else a body says.
ALPHABET = Alphabet(allow_x00=False, codec="utf-8")


def values(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    # Schemathesis' own generator (the engine of its positive phase), on a bare schema;
    # `whole_floats`: 16.0 is an integer in JSON Schema, and a client may send one.
    # Importing schemathesis blanks Hypothesis' printing of failing examples (a patch for
    # its speed), so every assertion here carries the body itself.
    return build(schema, draft=jsonschema_rs.Draft202012, formats={}, alphabet=ALPHABET, whole_floats=True)


def alone(endpoint: str, name: str) -> dict[str, Any]:
    """The minimal body's required parameters as they are, `name` drawn from its schema."""
    schema = SCHEMAS[endpoint]
    props = {k: {"const": v} for k, v in MINIMAL[endpoint].items()} | {name: schema["properties"][name]}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


# Derandomized: the same bodies every run. No explain phase: the failing body is in the assertion.
FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=False,
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])


# -- the answer, and the judgment ------------------------------------------------------


class _Checked(Exception):
    """The batch route got past every check it makes before the database."""


class _NoDatabase:
    def connect(self) -> Any:
        raise _Checked

    begin = connect


@dataclass(frozen=True)
class BatchAccepted:
    body: CreateBatch


Answer = GenerationRequest | EmbeddingRequest | ProtocolError | BatchAccepted


def answer(endpoint: str, body: dict[str, Any]) -> Answer:
    body = copy.deepcopy(body)
    if endpoint == EMBEDDINGS:
        return embeddings.parse(body, LIMITS)
    if endpoint != BATCHES:
        return parse(endpoint, body, LIMITS)
    try:
        checked = CreateBatch.model_validate(body)
    except pydantic.ValidationError as e:  # as the app answers one (api/errors.py)
        first = e.errors()[0]
        return ProtocolError(400, "invalid_request", first["msg"], ".".join(str(p) for p in first["loc"]) or None)
    # Stepped by hand, not on an event loop: everything it checks comes before its first
    # await, and a test's loop is pytest-asyncio's to keep.
    route = create(checked, SimpleNamespace(db=_NoDatabase(), settings=Settings()), "tenant")  # type: ignore[arg-type]
    try:
        route.send(None)
    except _Checked:
        return BatchAccepted(checked)
    except APIError as e:
        return ProtocolError(e.status, e.code or "", e.message, e.param)
    finally:
        route.close()
    raise AssertionError("the batch route awaited something before reaching the database")


def _path(param: str | None) -> str:
    return re.sub(r"\[\d+\]", "[]", param or "")


def _within(path: str, key: str) -> bool:
    return path == key or path.startswith((key + ".", key + "["))


_MISSING = object()


def _at(body: Any, param: str | None) -> Any:
    """The value `param` (`messages[0].content`) names in `body`; _MISSING where none."""
    if not param:
        return _MISSING
    value = body
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", param):
        if part.startswith("["):
            i = int(part[1:-1])
            value = value[i] if isinstance(value, list) and i < len(value) else _MISSING
        else:
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def fault(endpoint: str, body: dict[str, Any], got: Answer) -> str | None:
    """What is wrong with answering `body` (valid by OpenAI's schema) with `got`; None: nothing."""
    if not isinstance(got, ProtocolError):
        return None
    said = f"{got.status_code} {got.code} param={got.param!r}: {got.message}"
    if not 400 <= got.status_code < 500:
        return f"not a 4xx: {said}"
    if endpoint in DELIBERATE_REFUSALS:
        return None
    if got.param and _at(body, got.param) is None:
        return f"a null refused (null is the parameter's absence, or its default): {said}"
    if endpoint == BATCHES and got.param == "endpoint" and body.get("endpoint") in DELIBERATE_REFUSALS:
        return None
    for rule in BEYOND_THE_SCHEMA:
        if rule.code == got.code and rule.param in (None, got.param) and rule.broken(endpoint, body):
            return None
    path = _path(got.param)
    if any(_within(path, key) for key in DELIBERATE_REFUSALS if not key.startswith("/")):
        return None if got.code in DELIBERATE_CODES else f"a deliberate refusal not said as one: {said}"
    return f"refused: {said}"


def same(a: Answer, b: Answer) -> bool:
    if isinstance(a, ProtocolError) and isinstance(b, ProtocolError):
        return (a.status_code, a.code, a.param) == (b.status_code, b.code, b.param)
    return a == b


def answered(endpoint: str, body: dict[str, Any]) -> Answer:
    """The answer; an answer that raises instead fails, naming the body."""
    try:
        return answer(endpoint, body)
    except Exception as e:
        raise AssertionError(f"{endpoint} {json.dumps(body)[:2000]}\nraised {e!r}") from e


def check(endpoint: str, body: dict[str, Any]) -> None:
    assert VALIDATORS[endpoint].is_valid(body), list(VALIDATORS[endpoint].iter_errors(body))[:1]
    problem = fault(endpoint, body, answered(endpoint, body))
    assert problem is None, f"{endpoint} {json.dumps(body)[:2000]}\n{problem}"


# -- defaults and nulls, anywhere in a body ----------------------------------------------


def _branch(schema: dict[str, Any], value: Any) -> dict[str, Any]:
    """The schema `value` is read by: through anyOf/oneOf, the branch it matches."""
    for key in ("anyOf", "oneOf"):
        for b in schema.get(key, ()):
            if admits(b, value):
                return _branch(b, value)
    return schema


def spelled_out(value: Any, schema: dict[str, Any], nulls: bool) -> Any:
    """`value` with every absent property that declares a default set to it (`nulls`: every
    absent optional one that admits null set to null), at every depth."""
    schema = _branch(schema, value)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [spelled_out(v, schema["items"], nulls) for v in value]
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = {k: spelled_out(v, schema["properties"].get(k, {}), nulls) for k, v in value.items()}
    for name, prop in schema["properties"].items():
        if name in out or name in schema.get("required", ()):
            continue
        has, default = declared_default(prop)
        if nulls and admits(prop, None):
            out[name] = None
        elif not nulls and has and admits(prop, default):
            out[name] = default
    return out


# -- the tests ---------------------------------------------------------------------------


def test_the_subset_says_where_it_is_from_and_holds_what_it_references():
    source = SPEC["source"]
    assert source["repository"] == "https://github.com/openai/openai-openapi"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and source["info.version"] and source["fetched"]
    text = json.dumps(SPEC)
    for ref in set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', text)):
        assert ref in SPEC["components"]["schemas"], ref
    assert len(text) < 1_000_000


def _reaches(schema: dict[str, Any], parts: list[str]) -> bool:
    if not parts:
        return True
    if any(_reaches(b, parts) for b in [*schema.get("anyOf", ()), *schema.get("oneOf", ())]):
        return True
    if parts[0] == "[]":
        return isinstance(schema.get("items"), dict) and _reaches(schema["items"], parts[1:])
    prop = schema.get("properties", {}).get(parts[0])
    return prop is not None and _reaches(prop, parts[1:])


def test_what_is_refused_is_in_the_spec():
    """Every deliberate refusal and every unstated rule names what OpenAI's spec has: the
    list documents this deployment against that spec, nothing else."""
    endpoints = {*SCHEMAS[BATCHES]["properties"]["endpoint"]["enum"], EMBEDDINGS}
    for key in DELIBERATE_REFUSALS:
        if key.startswith("/"):
            assert key in endpoints and key not in SERVED, key
        else:
            parts = re.findall(r"[^.\[\]]+|\[\]", key)
            assert any(_reaches(SCHEMAS[e], parts) for e in (CHAT, COMPLETIONS)), key
    for rule in BEYOND_THE_SCHEMA:
        assert rule.param is None or any(rule.param in SCHEMAS[e]["properties"] for e in SERVED), rule


def test_the_minimal_bodies_are_valid_and_served():
    for endpoint, body in MINIMAL.items():
        assert VALIDATORS[endpoint].is_valid(body), endpoint
        assert not isinstance(answer(endpoint, body), ProtocolError), answer(endpoint, body)


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_every_valid_body_is_served_or_deliberately_refused(operation):
    endpoint = OPERATIONS[operation]
    examples = 300 if endpoint in SERVED else 20

    @settings(max_examples=examples, **FUZZ)
    @given(body=values(SCHEMAS[endpoint]))
    def run(body):
        check(endpoint, body)

    run()


PARAMETERS = [pytest.param(endpoint, name, id=f"{SHORT[endpoint]}:{name}")
              for endpoint in SERVED for name in SCHEMAS[endpoint]["properties"]]


@pytest.mark.parametrize("endpoint, name", PARAMETERS)
def test_each_parameter_alone_is_served_or_deliberately_refused(endpoint, name):
    @settings(max_examples=40, **FUZZ)
    @given(body=values(alone(endpoint, name)))
    def run(body):
        check(endpoint, body)

    run()


@pytest.mark.parametrize("endpoint, name", PARAMETERS)
@pytest.mark.parametrize("nulls", [False, True], ids=["defaults", "nulls"])
def test_each_parameter_alone_means_the_same_with_its_defaults_and_nulls_spelled_out(endpoint, name, nulls):
    """Inside one parameter (a message's `refusal`: null, a schema's `strict`: false): a
    whole random body is nearly always refused for something else first."""
    prop = SCHEMAS[endpoint]["properties"][name]

    @settings(max_examples=40, **FUZZ)
    @given(body=values(alone(endpoint, name)))
    def run(body):
        full = body | {name: spelled_out(body[name], prop, nulls)}
        a, b = answered(endpoint, body), answered(endpoint, full)
        assert same(a, b), f"{json.dumps(body)[:1000]}\n -> {a}\n{json.dumps(full)[:1000]}\n -> {b}"

    run()


DEFAULTS = [pytest.param(endpoint, name, default, id=f"{SHORT[endpoint]}:{name}={json.dumps(default)}")
            for endpoint in SERVED for name, prop in SCHEMAS[endpoint]["properties"].items()
            for has, default in [declared_default(prop)] if has]
NULLABLE = [pytest.param(endpoint, name, id=f"{SHORT[endpoint]}:{name}")
            for endpoint in SERVED for name, prop in SCHEMAS[endpoint]["properties"].items() if admits(prop, None)]


@pytest.mark.parametrize("endpoint, name, default", DEFAULTS)
def test_spelling_a_default_changes_nothing(endpoint, name, default):
    if name in SCHEMAS[endpoint].get("required", ()):
        pytest.skip(f"`{name}` is required: there is no body without it (see the test of nulls)")
    body = MINIMAL[endpoint] | {name: default}
    check(endpoint, body)
    assert same(answer(endpoint, body), answer(endpoint, MINIMAL[endpoint])), answer(endpoint, body)


@pytest.mark.parametrize("endpoint, name", NULLABLE)
def test_null_is_absent(endpoint, name):
    """An optional parameter's null is its absence; a required one's, its default."""
    body = MINIMAL[endpoint] | {name: None}
    check(endpoint, body)
    if name in SCHEMAS[endpoint].get("required", ()):
        has, default = declared_default(SCHEMAS[endpoint]["properties"][name])
        assert has, f"`{name}` is required and nullable with no default: null means nothing"
        like = MINIMAL[endpoint] | {name: default}
    else:
        like = MINIMAL[endpoint]
    assert same(answer(endpoint, body), answer(endpoint, like)), answer(endpoint, body)


@pytest.mark.parametrize("endpoint", SERVED, ids=SHORT.get)
@pytest.mark.parametrize("nulls", [False, True], ids=["defaults", "nulls"])
def test_defaults_and_nulls_spelled_out_anywhere_change_nothing(endpoint, nulls):
    schema = SCHEMAS[endpoint]

    @settings(max_examples=100, **FUZZ)
    @given(body=values(schema))
    def run(body):
        full = spelled_out(body, schema, nulls)
        assert VALIDATORS[endpoint].is_valid(full), list(VALIDATORS[endpoint].iter_errors(full))[:1]
        a, b = answered(endpoint, body), answered(endpoint, full)
        assert same(a, b), f"{json.dumps(body)[:1000]}\n -> {a}\n{json.dumps(full)[:1000]}\n -> {b}"

    run()
