"""JSON schemas of what this deployment accepts, for /openapi.json: the chat and
completions request bodies, and OpenAI's error object. Pure data.

The handlers read raw JSON (`protocol.requests.parse` judges it, so a batch line and an
interactive request meet the same rules), which leaves FastAPI nothing to describe; these
schemas say the same thing as `parse`, parameter by parameter: a parameter accepted only
at its default has that default as its only value, one not supported at all only `null`.
`tests/api/test_schema.py` holds the two to the same parameter names, and fuzzes the one
against the other. What a schema cannot say is in the descriptions: the model must be the
served one (else 404), and a `max_tokens` beyond the context length is a 400.
"""

from __future__ import annotations

from typing import Any

from protocol.requests import INT64, MAX_CHOICES, MAX_LOGPROBS, MAX_STOP, ROLES
from protocol.tiers import SERVICE_TIERS

# A seed is any int64; the schema states a range a little inside it, so that a client whose
# JSON numbers are doubles (ULP 2,048 at 2**63) cannot round a seed it thinks valid to one
# just past int64's ends (schemathesis found -9223372036854776000).
SEED_RANGE = (INT64[0] + 4096, INT64[1] - 4096)

Schema = dict[str, Any]

_NULL: Schema = {"type": "null"}


def _opt(schema: Schema) -> Schema:
    """Optional parameters may be absent or null alike (`parse` reads both as absent)."""
    return {"anyOf": [schema, _NULL]}


def _only(value: Any, why: str) -> Schema:
    return _opt({"const": value, "description": why})


# Text anywhere in a request: Postgres cannot hold NUL (nor a tokenizer encode a lone
# surrogate, which JSON text cannot carry unescaped anyway).
_TEXT: Schema = {"type": "string", "pattern": "^[^\\u0000]*$"}


def _string(description: str | None = None, **more: Any) -> Schema:
    return _TEXT | more | ({"description": description} if description else {})


_NOT_SUPPORTED = {**_NULL, "description": "Not supported by this deployment: absent or null only."}
_TEXT_PART: Schema = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                      "properties": {"type": {"const": "text"}, "text": _TEXT,
                                     "prompt_cache_breakpoint": {"type": "object",
                                                                 "description": "Ignored: vLLM caches prefixes "
                                                                                "by itself."}}}
_REFUSAL_PART: Schema = {"type": "object", "required": ["type", "refusal"], "additionalProperties": False,
                         "properties": {"type": {"const": "refusal"}, "refusal": _TEXT}}
_USER_CONTENT: Schema = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT_PART}]}
_TOOL_CALL: Schema = {
    "type": "object", "required": ["id", "type", "function"], "additionalProperties": False,
    "properties": {"id": _TEXT, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"], "additionalProperties": False,
        "properties": {"name": _TEXT, "arguments": _TEXT}}}}
_MESSAGE: Schema = {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"anyOf": [_TEXT, {"type": "array", "items": {"anyOf": [_TEXT_PART, _REFUSAL_PART]}}, _NULL]},
        "name": _opt(_TEXT),
        "refusal": _opt(_TEXT),
        "tool_calls": _opt({"type": "array", "items": _TOOL_CALL, "description": "An assistant's earlier calls."}),
        "tool_call_id": _opt(_TEXT | {"description": "A tool's message: the call it answers."}),
        **{k: {**_NULL, "description": "No audio or (deprecated) function calls: null only."}
           for k in ("audio", "function_call")},
    },
    "description": "Only an assistant's message may lack content (its `refusal` is then what it said, or it made "
                   "only tool calls), hold refusal parts or tool calls; only a tool's answers a call, which it "
                   "must name.",
    "allOf": [
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"required": ["content"], "properties": {"content": _USER_CONTENT, "tool_calls": _NULL,
                                                          "refusal": _NULL}}},
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"name": _NULL, "tool_call_id": _TEXT}},
         "else": {"properties": {"tool_call_id": _NULL}}},
    ],
}
_TOOL: Schema = {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _opt(_TEXT),
                       "parameters": _opt({"type": "object", "description": "A JSON schema of the arguments."}),
                       "strict": _opt({"type": "boolean", "description": "Arguments constrained to the schema "
                                                                         "(where the model's parser does so)."})}}}}
_NAMED_TOOL: Schema = {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False, "properties": {"name": _TEXT}}}}

_COMMON: dict[str, Schema] = dict(
    model=_string("The served model's name (GET /v1/models); another one is a 404."),
    max_tokens=_opt({"type": "integer", "minimum": 1,
                     "description": "At most the model's context length (else a 400)."}),
    temperature=_opt({"type": "number", "minimum": 0, "maximum": 2}),
    top_p=_opt({"type": "number", "minimum": 0, "maximum": 1, "description": "0: the likeliest token (greedy)."}),
    n=_opt({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
            "description": "Choices, each its own generation (choice i samples with seed + i); above 1 only when "
                           "sampling (temperature and top_p above 0)."}),
    seed=_opt({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
    stop=_opt({"anyOf": [_string(), {"type": "array", "maxItems": MAX_STOP, "items": _string()}],
               "description": "An empty string stops nothing."}),
    stream=_opt({"type": "boolean"}),
    stream_options=_opt({"type": "object", "additionalProperties": False,
                         "properties": {"include_usage": _opt({"type": "boolean"}),
                                        "include_obfuscation": _opt({"type": "boolean",
                                                                     "description": "No padding is sent."})},
                         "description": "Only with `stream`: true."}),
    service_tier=_opt({"enum": ["auto", *SERVICE_TIERS]}),
    presence_penalty=_opt({"type": "number", "minimum": -2, "maximum": 2}),
    frequency_penalty=_opt({"type": "number", "minimum": -2, "maximum": 2}),
    logit_bias=_opt({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {
        "type": "number", "description": "Clamped to [-100, 100], as vLLM does."},
        "description": "Token id to a bias added to its logit; ids within the model's vocabulary."}),
    user=_opt(_string()),
    # vLLM's own sampling parameters, as its OpenAI server takes them.
    ignore_eos=_opt({"type": "boolean", "description": "vLLM's extension: generate max_tokens whatever comes."}),
    top_k=_opt({"type": "integer", "minimum": -1, "description": "vLLM's: 0 or -1 for every token."}),
    min_p=_opt({"type": "number", "minimum": 0, "maximum": 1}),
    repetition_penalty=_opt({"type": "number", "exclusiveMinimum": 0}),
    min_tokens=_opt({"type": "integer", "minimum": 0,
                     "description": "At most max_tokens (else a 400, min_tokens_exceed_max_tokens)."}),
    stop_token_ids=_opt({"type": "array", "items": {"type": "integer", "minimum": 0},
                         "description": "Token ids within the model's vocabulary."}),
    include_stop_str_in_output=_opt({"type": "boolean"}),
    skip_special_tokens=_opt({"type": "boolean"}),
    spaces_between_special_tokens=_opt({"type": "boolean"}),
    structured_outputs=_opt({"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
                             "properties": {"json": {"anyOf": [{"type": "object"}, _TEXT]},
                                            "json_object": {"const": True},
                                            "regex": _string(minLength=1), "grammar": _string(minLength=1),
                                            "choice": {"type": "array", "minItems": 1, "items": _TEXT}},
                             "description": "vLLM's: one constraint; not with a response_format that constrains, "
                                            "nor with min_tokens (else a 400)."}),
)

_CHAT: dict[str, Schema] = dict(
    _COMMON,
    messages={"type": "array", "minItems": 1, "items": _MESSAGE},
    max_completion_tokens=_opt({"type": "integer", "minimum": 1}),
    logprobs=_opt({"type": "boolean"}),
    top_logprobs=_opt({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                       "description": "Only with `logprobs`: true (else a 400)."}),
    chat_template_kwargs=_opt({"type": "object", "description": "vLLM's: variables for the chat template."}),
    store=_only(False, "Stored completions are not supported."),
    metadata=_opt({"type": "object", "maxProperties": 16, "propertyNames": _string(maxLength=64),
                   "additionalProperties": _string(maxLength=512)}),
    response_format=_opt({"anyOf": [
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
         "properties": {"type": {"const": "json_schema"}, "json_schema": {
             "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                 "name": _TEXT, "description": _opt(_TEXT),
                 "schema": _opt({"type": "object"}), "strict": _opt({"type": "boolean"})}}}}],
        "description": "Structured outputs, as vLLM serves them; a schema xgrammar cannot compile is a 400."}),
    tools=_opt({"type": "array", "items": _TOOL,
                "description": "Function tools, of distinct names: rendered by the model's chat template and read "
                               "from its output by the vLLM tool parser configured for the model (a model with none "
                               "takes them only with `tool_choice` none)."}),
    functions=_opt({"type": "array", "maxItems": 0, "description": "Deprecated function calling: use `tools`."}),
    tool_choice=_opt({"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_TOOL],
                      "description": "`required` or a named function (which must be among `tools`) need tools and "
                                     "take no structured outputs besides: the parser constrains the calls."}),
    function_call=_opt({"enum": ["none", "auto"], "description": "Deprecated function calling: use `tools`."}),
    parallel_tool_calls=_opt({"type": "boolean"}),
    modalities=_only(["text"], "Text output only."),
    safety_identifier=_opt(_string()),
    prompt_cache_key=_opt(_string()),
    reasoning_effort=_only("medium", "The served model's reasoning is not set per request."),
    verbosity=_only("medium", "The served model's verbosity is not set per request."),
    **{name: _NOT_SUPPORTED for name in (
        "audio", "prediction", "web_search_options", "moderation",
        "prompt_cache_options", "prompt_cache_retention")},
)

_TOKEN_IDS: Schema = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                      "description": "Token ids, within the model's vocabulary."}

_COMPLETIONS: dict[str, Schema] = dict(
    _COMMON,
    prompt={"anyOf": [_TEXT, _TOKEN_IDS, {"type": "array", "minItems": 1, "maxItems": 1,
                                          "items": {"anyOf": [_TEXT, _TOKEN_IDS]}}, _NULL],
            "description": "One prompt: a text, or token ids (or a list of one of those); null: "
                           "\"<|endoftext|>\", OpenAI's default."},
    echo=_opt({"type": "boolean", "description": "The prompt's text (and, with `logprobs`, its tokens' logprobs) "
                                                 "before the completion's; `max_tokens` 0 then: the prompt alone."}),
    suffix=_only("", "suffix is not supported."),
    best_of=_only(1, "best_of > 1 is not supported."),
    logprobs=_opt({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
)

_WHOLE = ("Unknown parameters are a 400; so is text holding NUL or a lone surrogate, anywhere. A body over "
          "the deployment's size limit (BALLAST_MAX_REQUEST_BYTES) is a 413. "
          "`stream_options` needs `stream`: true.")


def _request(title: str, properties: dict[str, Schema], required: list[str]) -> Schema:
    return {"title": title, "type": "object", "description": _WHOLE, "required": required,
            "additionalProperties": False, "properties": properties,
            "allOf": [
                # stream_options without stream is a 400 (`parse` says so too).
                {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
                 "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
                # So is asking for top logprobs without logprobs.
                {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer",
                                                                                       "minimum": 1}}},
                 "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
                # And several choices of greedy sampling (one text n times; vLLM refuses it too).
                {"if": {"required": ["n"], "properties": {"n": {"type": "integer", "minimum": 2}}},
                 "then": {"properties": {"temperature": {"not": {"const": 0}}, "top_p": {"not": {"const": 0}}}}},
            ]}


def chat_request() -> Schema:
    return _request("CreateChatCompletionRequest", _CHAT, ["model", "messages"])


def completions_request() -> Schema:
    schema = _request("CreateCompletionRequest", _COMPLETIONS | dict(max_tokens=_opt({
        "type": "integer", "minimum": 0, "description": "0 only with `echo`: the prompt alone."})), ["model", "prompt"])
    schema["allOf"].append({"if": {"not": {"required": ["echo"], "properties": {"echo": {"const": True}}}},
                            "then": {"properties": {"max_tokens": _opt({"type": "integer", "minimum": 1})}}})
    return schema


def embeddings_request() -> Schema:
    from protocol.embeddings import MAX_INPUTS

    text = _string(minLength=1)
    inputs = {"anyOf": [text, _TOKEN_IDS, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": text},
                        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _TOKEN_IDS}],
              "description": "A text, token ids, or a list of either (one kind), each within the model's context."}
    return {"title": "CreateEmbeddingRequest", "type": "object", "required": ["model", "input"],
            "additionalProperties": False, "description": _WHOLE.split(" `stream_options`")[0],
            "properties": dict(
                model=_string(), input=inputs,
                encoding_format=_opt({"enum": ["float", "base64"],
                                      "description": "base64: little-endian float32, as OpenAI's client reads it."}),
                dimensions=_opt({"type": "integer", "minimum": 1,
                                 "description": "Only where the model has Matryoshka embeddings (else a 400)."}),
                user=_opt(_string()),
                add_special_tokens=_opt({"type": "boolean", "description": "vLLM's (default true)."}))}


def request_body(schema: Schema) -> dict[str, Any]:
    """For a route's `openapi_extra`: a required JSON body with this schema."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


ERROR: Schema = {
    "title": "Error", "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

_WHY = {400: "The request is invalid; `error.param` names what.", 401: "No API key, or not a valid one.",
        403: "The key may not do this.", 404: "Not found.",
        409: "It conflicts with what exists: it exists already, is still in use, or a limit is reached.",
        413: "The body is too large, or more than the tenant may store.",
        429: "Over a limit; `Retry-After` says when to try again.",
        502: "The engine worker failed; try again.",
        503: "Unavailable for now; try again."}


def errors(*statuses: int) -> dict[int | str, Any]:
    """For a route's `responses=`: these statuses, and any other 4xx, in OpenAI's error
    shape. Declaring "4XX" also keeps FastAPI from documenting its 422, which this API
    never sends (its validation errors are 400s)."""
    content = {"application/json": {"schema": ERROR}}
    out: dict[int | str, Any] = {s: {"description": _WHY[s], "content": content} for s in statuses}
    out["4XX"] = {"description": "The request was refused; the error says why.", "content": content}
    return out


def embeddings_responses() -> dict[int | str, Any]:
    """For the embeddings route's `responses=`."""
    ok = {"description": "One embedding per input, in order (CreateEmbeddingResponse).",
          "content": {"application/json": {"schema": {"type": "object"}}}}
    return {200: ok, **errors(400, 404, 413, 502, 503)}


def generation_responses() -> dict[int | str, Any]:
    """For the chat and completions routes' `responses=`."""
    ok = {"description": "The completion; with `stream`: true, server-sent events ending in `data: [DONE]` "
                         "(a failure after the first event is an error event, then `data: [DONE]`).",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {200: ok, **errors(400, 404, 413, 502, 503)}
