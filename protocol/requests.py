"""Chat and completions requests: every OpenAI parameter is either supported end to end
or refused with a 400 whose `param` names it. A batch line and an interactive request
pass the same checks; what vLLM would refuse (types, ranges, nulls where a value is
needed, context length) is refused here, before any engine sees it.

Supported, and what a preemption keeps (a preempted batch item resumes as a new vLLM
request whose prompt holds the tokens it had):

- `temperature` 0 (greedy) resumes token for token as the uninterrupted run; with
  `temperature` > 0 a resumed generation is a valid sample but not the same one (`seed`
  included: vLLM's sampler state is not carried across a resume). `top_p`, `top_k` and
  `min_p` only narrow what is sampled.
- Stop strings are applied to the whole text, so one that straddles a resume is still
  honoured; so are `stop_token_ids`, `include_stop_str_in_output` and the detokenizer's
  options, which apply once, to all the tokens, at the end.
- `logit_bias` is the same at every step. Penalties and structured outputs
  (`response_format`, vLLM's `structured_outputs`) are state vLLM keeps of a request's
  output: a resumed request carries them (engine/logits.py), so its penalties count the
  tokens it had as output and its grammar goes on from where they left it; greedy, the
  finished output is the uninterrupted run's. `min_tokens` with structured outputs is
  refused (a resumed grammar's minimum would count anew).
- `min_tokens` counts the tokens already had.
- `echo` (completions): the prompt's text, and with `logprobs` its tokens' logprobs (vLLM's
  prompt logprobs, computed over the prompt alone), before the completion's; `max_tokens`
  0 with it is the prompt alone (vLLM still generates, and counts, one token).
- `logprobs`: each token's, with its top alternatives, is journaled with the token, so a
  resumed item's are whole; but vLLM computes them before logits processors run (and after
  masking a grammar), so a resumed structured output's are of the unmasked logits.

- Tools (`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool`
  messages): rendered by the model's chat template as vLLM renders them, and the output
  parsed by the vLLM tool parser configured for the model (engine/tools.py); `required`
  and a named function constrain the output with a JSON schema, a grammar that resumes
  like any other. A model with no tool parser refuses tools it would have to parse.
- `n`: each choice is a generation of its own, journaled and resumed on its own (a batch
  item's choices may be preempted at different offsets); choice i samples with `seed` + i,
  as vLLM's parallel sampling does. Greedy (temperature 0) with `n` > 1 is refused, as vLLM
  refuses it: n copies of one text.

Everything else a request may say is either only its default (`best_of` = 1...) or a 400
naming the parameter.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol import keys
from protocol.errors import ProtocolError, bad_char
from protocol.tiers import SERVICE_TIERS, ServiceTier

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"  # protocol/embeddings.py
GENERATION = (CHAT, COMPLETIONS)
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)  # what a batch may run

ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_STOP = 4
# Each stop string is searched for in the whole text at every delta (and across a resume):
# a megabyte of them would be a cost the engine pays per token.
MAX_STOP_CHARS = 256
INT64 = (-(2**63), 2**63 - 1)
MIN_OVER_MAX = "min_tokens_exceed_max_tokens"  # a 400 no JSON schema can state (it compares two values)
# Tools that contradict each other or the rest (a named function not among them, two of
# one name, a forced call with structured outputs): a 400 no JSON schema can state.
TOOLS_CONFLICT = "invalid_tools"
MAX_CHOICES = 128  # `n`: OpenAI's maximum
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's chat maximum, and vLLM's default max_logprobs


@dataclass(frozen=True)
class RequestLimits:
    model: str  # the served model's name
    max_model_len: int
    adapters: frozenset[str] = frozenset()  # fine-tuned models served on it (the caller's own)
    any_adapter: bool = False  # any `ft:<model>:…` name (an engine worker: the API checked whose it is)
    others: tuple[str, ...] = ()  # the deployment's other models, for a 404 that names them all
    batch_model: bool = False  # a batch's: its file's first line chose `model` for every line

    def serves(self, name: str) -> bool:
        return name == self.model or name in self.adapters or (
            self.any_adapter and name.startswith(keys.fine_tuned_prefix(self.model)))


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()  # an assistant's: {id, type, function: {name, arguments}}
    tool_call_id: str | None = None  # a tool's: the call it answers

    def templated(self) -> dict[str, Any]:
        """The message as vLLM hands it to the chat template: each call's `arguments` an
        object, not the JSON text the client sent (one that is not a JSON object: {})."""
        out: dict[str, Any] = dict(role=self.role, content=self.content)
        if self.tool_calls:
            out["tool_calls"] = [dict(call, function=dict(call["function"], arguments=_arguments(call["function"])))
                                 for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    given = function.get("arguments")
    try:
        parsed = json.loads(given) if isinstance(given, str) and given else given
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {}


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: only what the engine needs, in plain types."""

    endpoint: str
    model: str
    messages: tuple[Message, ...] = ()  # chat
    prompt: str | tuple[int, ...] = ""  # completions: text, or token ids
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    service_tier: ServiceTier = "default"
    ignore_eos: bool = False  # a vLLM extension, handy for benchmarks
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id
    logprobs: int | None = None  # how many alternatives to give per token; None: no logprobs
    # vLLM's extras, as its OpenAI server takes them
    top_k: int = 0  # 0 (or -1): every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Structured outputs, as vLLM's StructuredOutputsParams keywords (one of GRAMMARS); None: text.
    grammar: dict[str, Any] | None = None
    # Tools, as vLLM renders them ({type, function: {name, description, parameters}}), and
    # the choice among them: "none", "auto", "required" or {"type": "function", "function":
    # {"name": …}}; no tools: () and None.
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # False: one call at most
    # Completions: the prompt's text (and, with logprobs, its tokens' logprobs) before the
    # completion's; `max_tokens` 0 then asks for the prompt alone.
    echo: bool = False
    # Choices: each its own generation (vLLM's parallel sampling: choice i samples with
    # `seed` + i); a batch item's are journaled and resumed each on its own.
    n: int = 1

    def chat_inputs(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools the chat template gets, as vLLM gives them to it."""
        return [m.templated() for m in self.messages], [dict(t) for t in self.tools] or None

    def forced_tool(self) -> bool:
        """Whether the output must be tool calls: `required`, or one tool named."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)


class Invalid(Exception):
    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.code, self.param, self.status = message, code, param, status


def parse(endpoint: str, body: Any, limits: RequestLimits, *, batch: bool = False) -> GenerationRequest | ProtocolError:
    """The request, or why it cannot run (never an exception, whatever `body` holds)."""
    try:
        return _parse(endpoint, body, limits, batch)
    except Invalid as e:
        return ProtocolError(e.status, e.code, e.message, e.param)


def _parse(endpoint: str, body: Any, limits: RequestLimits, batch: bool) -> GenerationRequest:
    if endpoint not in GENERATION:
        raise Invalid(f"Unsupported endpoint {endpoint!r}; use one of {', '.join(GENERATION)}.", param="url")
    if not isinstance(body, dict):
        raise Invalid("The request body must be a JSON object.", "invalid_request")
    unstorable(body)
    params = _CHAT if endpoint == CHAT else _COMPLETIONS
    if endpoint == COMPLETIONS and "prompt" not in body:  # required, though it may be null
        raise Invalid("`prompt` is required.", "missing_required_parameter", "prompt")
    for name in body:
        if name not in params:
            raise Invalid(f"Unrecognized request argument supplied: {name}", "unknown_parameter", name)
    v: dict[str, Any] = {}
    for name, check in params.items():
        value = body.get(name)
        try:
            v[name] = check(value)
        except Invalid as e:
            if e.param is None:  # about the parameter itself: say which
                e.param, e.message = name, f"`{name}` {e.message}"
            raise
    if not limits.serves(v["model"]):
        if limits.batch_model:
            raise Invalid(f"The model {v['model']!r} is not this batch's: a batch runs one model, and this one's "
                          f"first line names {limits.model!r}.", "model_not_found", "model", 404)
        served = ", ".join(repr(m) for m in sorted((limits.model, *limits.others)))
        raise Invalid(f"The model {v['model']!r} does not exist; this deployment serves {served}"
                      + (" and your fine-tuned models." if limits.adapters else "."), "model_not_found", "model", 404)
    for name in ("max_completion_tokens", "max_tokens"):
        if v.get(name) == 0 and not (endpoint == COMPLETIONS and v.get("echo")):
            raise Invalid(f"`{name}` must be at least 1: a request that generates nothing is served only as a "
                          "completion with `echo` (the prompt alone).", "unsupported_value", name)
    max_tokens = v.get("max_completion_tokens") or v["max_tokens"]
    if max_tokens is None and endpoint == COMPLETIONS:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens > limits.max_model_len:
        param = "max_completion_tokens" if v.get("max_completion_tokens") else "max_tokens"
        raise Invalid(f"`{param}` is {max_tokens}, beyond the model's context length of {limits.max_model_len} tokens.",
                   "context_length_exceeded", param)
    stream = bool(v["stream"])
    if stream and batch:
        raise Invalid("Streaming is not available inside a batch.", "unsupported_value", "stream")
    if v["stream_options"] is not None and not stream:
        raise Invalid("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    tier: ServiceTier = v["service_tier"] if v["service_tier"] in SERVICE_TIERS else "default"  # None, "auto": default
    stop = v["stop"]
    min_tokens = v["min_tokens"] or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise Invalid(f"`min_tokens` is {min_tokens}, more than `max_tokens` ({max_tokens}).", MIN_OVER_MAX,
                      "min_tokens")
    grammar = v["structured_outputs"]
    if v.get("response_format") is not None:
        if grammar is not None:
            raise Invalid("`response_format` and `structured_outputs` cannot both constrain the output.",
                          param="structured_outputs")
        grammar = v["response_format"]
    tools, tool_choice = v.get("tools") or (), v.get("tool_choice")
    if tool_choice not in (None, "none", "auto") and not tools:
        raise Invalid("`tool_choice` needs `tools`.", TOOLS_CONFLICT, "tool_choice")
    if isinstance(tool_choice, dict) and tool_choice["function"]["name"] not in [t["function"]["name"] for t in tools]:
        raise Invalid(f"`tool_choice` names the function {tool_choice['function']['name']!r}, which is not in `tools`.",
                      TOOLS_CONFLICT, "tool_choice")
    if not tools:
        tool_choice = None
    elif tool_choice is None:
        tool_choice = "auto"  # OpenAI's default where tools are given
    if grammar is not None and tool_choice not in (None, "none", "auto"):
        raise Invalid("Structured outputs and a forced tool call cannot both constrain the output (vLLM's parser "
                      "constrains a forced call itself).", TOOLS_CONFLICT, "tool_choice")
    if grammar is not None and min_tokens:
        # A resumed generation's grammar goes on from its tokens; a minimum would count anew.
        raise Invalid("`min_tokens` with structured outputs is not supported.", "unsupported_value", "min_tokens")
    temperature = 0.0 if v["top_p"] == 0 else 1.0 if v["temperature"] is None else float(v["temperature"])
    n = v["n"] or 1
    if n > 1 and temperature == 0:
        raise Invalid(f"`n` is {n} with greedy sampling (temperature 0), which gives one text {n} times: vLLM "
                      "refuses it, and so does Ballast. Sample (temperature > 0; top_k 1 is greedy's text).",
                      "unsupported_value", "n")
    if endpoint == CHAT:
        if v["top_logprobs"] and not v["logprobs"]:
            raise Invalid("`top_logprobs` needs `logprobs` to be true.", param="top_logprobs")
        logprobs = (v["top_logprobs"] or 0) if v["logprobs"] else None
    else:
        logprobs = v["logprobs"]
    return GenerationRequest(
        endpoint=endpoint,
        model=v["model"],
        messages=v.get("messages") or (),
        prompt=v.get("prompt") or "",
        max_tokens=max_tokens,
        # top_p 0 keeps only the likeliest token, which OpenAI accepts and vLLM does not: greedy.
        temperature=temperature,
        top_p=1.0 if v["top_p"] in (None, 0) else float(v["top_p"]),
        seed=v["seed"],
        stop=stop or (),
        stream=stream,
        include_usage=bool((v["stream_options"] or {}).get("include_usage")),
        service_tier=tier,
        ignore_eos=bool(v["ignore_eos"]),
        presence_penalty=float(v["presence_penalty"] or 0),
        frequency_penalty=float(v["frequency_penalty"] or 0),
        logit_bias=v["logit_bias"] or (),
        logprobs=logprobs,
        top_k=v["top_k"] or 0,
        min_p=float(v["min_p"] or 0),
        repetition_penalty=1.0 if v["repetition_penalty"] is None else float(v["repetition_penalty"]),
        min_tokens=min_tokens,
        stop_token_ids=tuple(v["stop_token_ids"] or ()),
        include_stop_str_in_output=bool(v["include_stop_str_in_output"]),
        skip_special_tokens=v["skip_special_tokens"] is not False,
        spaces_between_special_tokens=v["spaces_between_special_tokens"] is not False,
        chat_template_kwargs=v.get("chat_template_kwargs"),
        grammar=grammar,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=v.get("parallel_tool_calls") is not False,
        echo=bool(v.get("echo")),
        n=n,
    )


def order_matters(req: GenerationRequest) -> bool:
    """Whether the order of the request's keys is part of its meaning: a JSON schema's
    properties are generated in the order it gives them, and tools are written into the
    prompt as given."""
    return isinstance((req.grammar or {}).get("json"), dict) or bool(req.tools)


# -- what a text may hold -----------------------------------------------------------


def unstorable(value: Any, path: str = "") -> None:
    """Refuse NUL and lone surrogates anywhere: JSON allows them, but Postgres cannot
    store them, and a tokenizer cannot encode a lone surrogate."""
    if isinstance(value, str):
        bad = bad_char(value)
        if bad:
            raise Invalid(f"{bad} is not supported in requests" + (f" (in `{path}`)." if path else "."),
                       "unsupported_character", path or None)
    elif isinstance(value, dict):
        for k, item in value.items():
            where = f"{path}.{k}" if path else str(k)
            unstorable(k, where)
            unstorable(item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            unstorable(item, f"{path}[{i}]")


# -- value checks: each takes the JSON value (None when absent or null) -------------

Check = Callable[[Any], Any]


def _required(check: Check) -> Check:
    def run(value: Any) -> Any:
        if value is None:
            raise Invalid("is required.", "missing_required_parameter")
        return check(value)

    return run


def _optional(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise Invalid("must be a string.", "invalid_type")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid("must be a boolean.", "invalid_type")
    return value


def _whole(value: Any) -> int | None:
    """An integer as JSON Schema (and vLLM's pydantic) sees one: 16 or 16.0, never true."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _int(lo: int, hi: int | None = None) -> Check:
    def run(raw: Any) -> int:
        value = _whole(raw)
        if value is None:
            raise Invalid("must be an integer.", "invalid_type")
        if value < lo or (hi is not None and value > hi):
            raise Invalid(f"must be >= {lo}." if hi is None else f"must be between {lo} and {hi}.")
        return value

    return run


def _number(lo: float, hi: float, *, lo_open: bool = False) -> Check:
    def run(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise Invalid("must be a number.", "invalid_type")
        if value > hi or value < lo or (lo_open and value == lo):
            raise Invalid(f"must be {'>' if lo_open else '>='} {lo}" + (f" and <= {hi}." if hi < math.inf else "."))
        return value

    return run


def _only(default: Any, what: str) -> Check:
    """A parameter accepted only at its default (or an equivalent)."""
    defaults = default if isinstance(default, tuple) else (default,)

    def same(a: Any, b: Any) -> bool:  # True is not 1 here
        return a is b if isinstance(a, bool) or isinstance(b, bool) else a == b

    def run(value: Any) -> None:
        if not any(same(value, d) for d in defaults):
            alts = " or ".join(json.dumps(d) for d in defaults)
            raise Invalid(f"must be {alts} ({what}).", "unsupported_value")

    return run


def _tier(value: Any) -> str:
    if value == "auto" or value in SERVICE_TIERS:
        return str(value)
    if isinstance(value, str):  # OpenAI's "scale" and the like: capacity products of its own
        raise Invalid(f"{value!r} is not a tier this deployment offers: use one of auto, "
                      f"{', '.join(SERVICE_TIERS)}.", "unsupported_value")
    raise Invalid("must be a string.", "invalid_type")


def _max_tokens(value: Any) -> int:
    if _whole(value) == 0:  # OpenAI's completions take 0 with echo: the prompt alone (_parse judges it)
        return 0
    n: int = _int(1)(value)
    return n


def _stop(value: Any) -> tuple[str, ...]:
    """The stop strings; an empty one (which OpenAI accepts and vLLM refuses) stops nothing."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise Invalid("must be a string or a list of strings.", "invalid_type")
    if len(items) > MAX_STOP:
        raise Invalid(f"takes up to {MAX_STOP} strings.")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise Invalid(f"takes strings of at most {MAX_STOP_CHARS} characters.")
    return tuple(s for s in items if s)


def _stream_options(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid("must be an object.", "invalid_type")
    for k, v in value.items():
        # include_obfuscation: OpenAI pads stream events against length side channels;
        # Ballast sends none, so either value is served.
        if k not in ("include_usage", "include_obfuscation"):
            raise Invalid(f"Unrecognized stream option: {k}", "unknown_parameter", f"stream_options.{k}")
        if not isinstance(v, bool) and v is not None:
            raise Invalid(f"`stream_options.{k}` must be a boolean.", "invalid_type", f"stream_options.{k}")
    return value


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Invalid("must be an object of at most 16 string pairs.", "invalid_type")
    if len(value) > 16:
        raise Invalid("must be an object of at most 16 string pairs.")
    if not all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise Invalid("keys are at most 64 characters and values strings of at most 512.")
    return value


_TOKEN_ID = re.compile(r"-?[0-9]+")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """Token id (as a JSON key) to a bias; vLLM clamps each to [-100, 100], as done here."""
    if not isinstance(value, dict):
        raise Invalid("must be an object mapping token ids to biases.", "invalid_type")
    out: dict[int, float] = {}
    for k, bias in value.items():
        token = k.strip()
        if not _TOKEN_ID.fullmatch(token):  # ASCII digits only: int() would take "١" and refuse "¹"
            raise Invalid(f"has a key that is not a token id: {k!r}.", "invalid_value", "logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise Invalid(f"has a bias that is not a number (token {k}).", "invalid_type", "logit_bias")
        if int(token) < 0:
            raise Invalid(f"holds a negative token id ({token}).", "invalid_value", "logit_bias")
        out[int(token)] = max(-100.0, min(100.0, float(bias)))
    return tuple(sorted(out.items()))


def _token_ids(value: Any) -> tuple[int, ...]:
    ids = [_whole(t) for t in value] if isinstance(value, list) else None
    if ids is None or any(t is None for t in ids):
        raise Invalid("must be a list of token ids.", "invalid_type")
    if any(t < 0 for t in ids):  # type: ignore[operator]
        raise Invalid("holds a negative token id.")
    return tuple(ids)  # type: ignore[arg-type]


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid("must be an object.", "invalid_type")
    return value


def _empty_list(value: Any) -> None:
    if not isinstance(value, list):
        raise Invalid("must be a list.", "invalid_type")
    if value:
        raise Invalid("is not supported (deprecated function calling: use `tools`).", "unsupported_parameter")


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as vLLM's structured outputs (None: text), mapped as vLLM's
    OpenAI server maps it."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise Invalid("must be an object with a `type`.", "invalid_type")
    kind = value["type"]
    if kind == "text" or kind == "json_object":
        if set(value) != {"type"}:
            raise Invalid(f"of type {kind} takes only `type`.", "unknown_parameter")
        return None if kind == "text" else {"json_object": True}
    if kind != "json_schema":
        raise Invalid(f"of type {kind!r} is not supported: use text, json_object or json_schema.",
                      "unsupported_value")
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise Invalid("of type json_schema takes a `json_schema` object.", "invalid_type")
    for k, v in spec.items():
        ok = {"name": isinstance(v, str), "description": isinstance(v, str),
              "schema": isinstance(v, dict), "strict": isinstance(v, bool)}.get(k)
        if ok is None:
            raise Invalid(f"Unrecognized argument: json_schema.{k}", "unknown_parameter",
                          f"response_format.json_schema.{k}")
        if not ok and v is not None:
            raise Invalid(f"`response_format.json_schema.{k}` is not valid (a name and a description are strings, "
                          "a schema an object, strict a boolean).", "invalid_type",
                          f"response_format.json_schema.{k}")
    if not isinstance(spec.get("name"), str):
        raise Invalid("`response_format.json_schema.name` is required.", "missing_required_parameter",
                      "response_format.json_schema.name")
    schema = spec.get("schema")
    return {"json": schema} if schema is not None else {"json_object": True}  # no schema: any JSON object


GRAMMARS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured outputs' kinds


def _structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's own `structured_outputs`: one constraint of GRAMMARS."""
    if not isinstance(value, dict):
        raise Invalid("must be an object.", "invalid_type")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if unknown := sorted(set(given) - set(GRAMMARS)):
        raise Invalid(f"takes one of {', '.join(GRAMMARS)}; not {unknown[0]}.", "unsupported_parameter")
    if len(given) != 1:
        raise Invalid(f"takes exactly one of {', '.join(GRAMMARS)}.")
    (kind, v), = given.items()
    ok = {"json": isinstance(v, (dict, str)), "json_object": v is True, "regex": isinstance(v, str) and bool(v),
          "grammar": isinstance(v, str) and bool(v),
          "choice": isinstance(v, list) and bool(v) and all(isinstance(c, str) for c in v)}[kind]
    if not ok:
        raise Invalid(f"`structured_outputs.{kind}` is not valid: json a schema, json_object true, regex and "
                      "grammar non-empty strings, choice a non-empty list of strings.", "invalid_value",
                      f"structured_outputs.{kind}")
    return {kind: v}


def _unsupported(value: Any) -> None:
    raise Invalid("is not supported by this deployment.", "unsupported_parameter")


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise Invalid("must be a non-empty list of messages.", "invalid_type")
    return tuple(_message(i, m) for i, m in enumerate(value))


# What a message may carry that Ballast does not offer, and why (a 400 naming it).
_NOT_IN_MESSAGES = {"audio": "no audio answers to refer to",
                    "function_call": "no function calling (its successor, tools, is served)"}
_NOT_IN_PARTS = {"image_url": "the served models take text only", "input_audio": "the served models take text only",
                 "file": "no files in messages"}
_PART_KEYS = {"text": ("type", "text", "prompt_cache_breakpoint"), "refusal": ("type", "refusal")}


def _message(i: int, m: Any) -> Message:
    """One message as text. Explicit nulls are absent; an assistant's earlier refusal is
    the text it said; `prompt_cache_breakpoint` is a hint vLLM's automatic prefix cache
    does not need."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise Invalid(f"`{where}` must be an object with `role` and `content`.", "invalid_type", where)
    role = m.get("role")
    for k, v in m.items():
        if k in _NOT_IN_MESSAGES and v is not None:
            raise Invalid(f"`{where}.{k}` is not supported ({_NOT_IN_MESSAGES[k]}).", "unsupported_parameter",
                          f"{where}.{k}")
        if k not in _NOT_IN_MESSAGES and k not in _MESSAGE_KEYS.get(str(role), ("role", "content", "name")) and not (
                v is None and k in _MESSAGE_KEYS["assistant"] + _MESSAGE_KEYS["tool"]):  # another role's, null
            raise Invalid(f"Unrecognized message field: {k}", "unknown_parameter", f"{where}.{k}")
    if role == "function":
        raise Invalid(f"`{where}.role` 'function' is not supported (function calling's successor, tools, is).",
                      "unsupported_value", f"{where}.role")
    if role not in ROLES:
        raise Invalid(f"`{where}.role` must be one of {', '.join(ROLES)}.", "invalid_value", f"{where}.role")
    for k in ("name", "refusal", "tool_call_id"):
        if m.get(k) is not None and not isinstance(m[k], str):
            raise Invalid(f"`{where}.{k}` must be a string.", "invalid_type", f"{where}.{k}")
    if role == "tool" and m.get("tool_call_id") is None:
        raise Invalid(f"`{where}.tool_call_id` is required.", "missing_required_parameter", f"{where}.tool_call_id")
    calls = _tool_calls(f"{where}.tool_calls", m.get("tool_calls"))
    c = m.get("content")
    if c is None and role == "assistant":  # an assistant turn may be a refusal, or only tool calls
        return Message(role, m.get("refusal") or "", calls)
    if isinstance(c, str):
        return Message(role, c, calls, m.get("tool_call_id"))
    if not isinstance(c, list):
        raise Invalid(f"`{where}.content` must be a string or a list of text parts.", "invalid_type",
                      f"{where}.content")
    texts = []
    for j, part in enumerate(c):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NOT_IN_PARTS:
            raise Invalid(f"`{at}` is a {kind} part: not supported ({_NOT_IN_PARTS[kind]}).", "unsupported_value",
                          f"{at}.{kind}")
        keys = _PART_KEYS.get(kind or "", ())
        if not keys or not isinstance(part.get(kind), str) or any(k not in keys for k in part) or (
                kind == "refusal" and role != "assistant"):
            raise Invalid(f"`{at}` must be a text part (or an assistant's refusal).", "invalid_type", at)
        texts.append(part[kind])
    # A tool's parts are one text a line apart, as vLLM gives them to the template.
    return Message(role, ("\n" if role == "tool" else "").join(texts), calls, m.get("tool_call_id"))


_MESSAGE_KEYS = {"assistant": ("role", "content", "name", "refusal", "tool_calls"),
                 "tool": ("role", "content", "tool_call_id")}


def _tool_calls(where: str, value: Any) -> tuple[dict[str, Any], ...]:
    """An assistant's earlier tool calls, as OpenAI has them: {id, type: function,
    function: {name, arguments}} (arguments the JSON text the model wrote)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Invalid(f"`{where}` must be a list of tool calls.", "invalid_type", where)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(call, dict) and call.get("type") == "custom":
            raise Invalid(f"`{at}` is a custom tool call: not supported (function tools only).", "unsupported_value",
                          f"{at}.type")
        if (not isinstance(call, dict) or call.get("type") != "function" or not isinstance(call.get("id"), str)
                or set(call) - {"id", "type", "function"} or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)
                or set(fn) - {"name", "arguments"}):
            raise Invalid(f"`{at}` must be {{id, type: \"function\", function: {{name, arguments}}}}, arguments "
                          "a string.", "invalid_type", at)
        calls.append(dict(id=call["id"], type="function", function=dict(name=fn["name"], arguments=fn["arguments"])))
    return tuple(calls)


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    """Function tools, as vLLM renders them for the chat template."""
    if not isinstance(value, list):
        raise Invalid("must be a list of tools.", "invalid_type")
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") == "custom":
            raise Invalid(f"`{at}` is a custom tool: not supported (function tools only).", "unsupported_value",
                          f"{at}.type")
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} \
                or not isinstance(fn, dict):
            raise Invalid(f"`{at}` must be {{type: \"function\", function: {{name, description, parameters}}}}.",
                          "invalid_type", at)
        if unknown := sorted(set(fn) - {"name", "description", "parameters", "strict"}):
            raise Invalid(f"Unrecognized argument: {at}.function.{unknown[0]}", "unknown_parameter",
                          f"{at}.function.{unknown[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise Invalid(f"`{at}.function.name` must be 1 to 64 letters, digits, underscores or dashes.",
                          "invalid_value", f"{at}.function.name")
        for k, kind, ok in (("description", "a string", str), ("parameters", "an object", dict),
                            ("strict", "a boolean", bool)):
            if fn.get(k) is not None and not isinstance(fn[k], ok):
                raise Invalid(f"`{at}.function.{k}` must be {kind}.", "invalid_type", f"{at}.function.{k}")
        function: dict[str, Any] = dict(name=name, description=fn.get("description"), parameters=fn.get("parameters"))
        if fn.get("strict"):  # rendered where true; false is its absence (vLLM would render it)
            function["strict"] = True
        tools.append(dict(type="function", function=function))
    if len({fn["name"] for fn in (t["function"] for t in tools)}) < len(tools):
        raise Invalid("names one function twice.", TOOLS_CONFLICT)
    return tuple(tools)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tool_choice(value: Any) -> str | dict[str, Any]:
    if value in ("none", "auto", "required"):
        return str(value)
    if isinstance(value, dict) and value.get("type") in ("allowed_tools", "custom"):
        raise Invalid(f"of type {value['type']!r} is not supported (none, auto, required or one function).",
                      "unsupported_value")
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type") != "function" or set(value) - {"type", "function"} \
            or not isinstance(fn.get("name"), str) or set(fn) != {"name"}:
        raise Invalid('must be "none", "auto", "required" or {"type": "function", "function": {"name": …}}.')
    return dict(type="function", function=dict(name=fn["name"]))


PROMPT_DEFAULT = "<|endoftext|>"  # OpenAI's, for a null prompt


def _prompt(value: Any) -> str | tuple[int, ...]:
    """One prompt: a text, token ids, or a list holding one of those."""
    if value is None:
        return PROMPT_DEFAULT
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
        if isinstance(value, str):
            return value
    given = [_whole(t) for t in value] if isinstance(value, list) else []
    ids = [t for t in given if t is not None]
    if ids and len(ids) == len(given):
        if min(ids) < 0:
            raise Invalid("holds a negative token id.")
        return tuple(ids)
    if isinstance(value, list) and len(value) != 1 and all(isinstance(p, (str, list)) for p in value):
        raise Invalid("must be one prompt: send one request per prompt (or a batch).", "unsupported_value")
    raise Invalid("must be a string or a non-empty list of token ids.", "invalid_type")


_COMMON: dict[str, Check] = dict(
    model=_required(_string),
    max_tokens=_optional(_max_tokens),
    temperature=_optional(_number(0, 2)),
    top_p=_optional(_number(0, 1)),
    n=_optional(_int(1, MAX_CHOICES)),
    seed=_optional(_int(*INT64)),
    stop=_optional(_stop),
    stream=_optional(_bool),
    stream_options=_optional(_stream_options),
    service_tier=_optional(_tier),
    presence_penalty=_optional(_number(-2, 2)),
    frequency_penalty=_optional(_number(-2, 2)),
    logit_bias=_optional(_logit_bias),
    user=_optional(_string),
    # vLLM's own sampling parameters, as its OpenAI server takes them.
    ignore_eos=_optional(_bool),
    top_k=_optional(_int(-1)),
    min_p=_optional(_number(0, 1)),
    repetition_penalty=_optional(_number(0, math.inf, lo_open=True)),
    min_tokens=_optional(_int(0)),
    stop_token_ids=_optional(_token_ids),
    include_stop_str_in_output=_optional(_bool),
    skip_special_tokens=_optional(_bool),
    spaces_between_special_tokens=_optional(_bool),
    structured_outputs=_optional(_structured_outputs),
)

_CHAT: dict[str, Check] = dict(
    _COMMON,
    messages=_required(_messages),
    max_completion_tokens=_optional(_max_tokens),
    logprobs=_optional(_bool),
    top_logprobs=_optional(_int(0, MAX_LOGPROBS)),
    chat_template_kwargs=_optional(_object),
    store=_optional(_only(False, "store is not supported")),
    metadata=_optional(_metadata),
    response_format=_optional(_response_format),
    tools=_optional(_tools),
    functions=_optional(_empty_list),
    tool_choice=_optional(_tool_choice),
    function_call=_optional(_only(("none", "auto"), "deprecated function calling: use `tools`")),
    parallel_tool_calls=_optional(_bool),
    modalities=_optional(_only((["text"],), "only text output is supported")),
    safety_identifier=_optional(_string),
    prompt_cache_key=_optional(_string),
    reasoning_effort=_optional(_only("medium", "the served model's reasoning is not set per request")),
    verbosity=_optional(_only("medium", "the served model's verbosity is not set per request")),
    audio=_optional(_unsupported),
    prediction=_optional(_unsupported),
    web_search_options=_optional(_unsupported),
    moderation=_optional(_unsupported),
    prompt_cache_options=_optional(_unsupported),
    prompt_cache_retention=_optional(_unsupported),
)

_COMPLETIONS: dict[str, Check] = dict(
    _COMMON,
    prompt=_prompt,
    echo=_optional(_bool),
    suffix=_optional(_only("", "suffix is not supported")),
    best_of=_optional(_only(1, "best_of > 1 is not supported")),
    logprobs=_optional(_int(0, MAX_LOGPROBS)),
)


# -- what needs the engine's tokenizer ----------------------------------------------


def check_prompt_ids(ids: list[int], max_token_id: int) -> ProtocolError | None:
    """Token ids given as the prompt must exist in the model's vocabulary."""
    worst = max(ids, default=0)
    if worst > max_token_id:
        return ProtocolError(400, "invalid_value",
                             f"Token id {worst} is out of vocabulary (the largest is {max_token_id}).", "prompt")
    return None


def fit_context(req: GenerationRequest, prompt_len: int, max_model_len: int) -> int | ProtocolError:
    """How many tokens the completion may take, or why the request does not fit."""
    room = max_model_len - prompt_len
    wanted = req.max_tokens
    if room < 1 or (wanted is not None and wanted > room):
        return ProtocolError(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + (wanted or 1)} tokens ({prompt_len} in the prompt, {wanted or 1} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            "max_tokens" if wanted and room >= 1 else ("messages" if req.endpoint == CHAT else "prompt"),
        )
    return wanted or room
