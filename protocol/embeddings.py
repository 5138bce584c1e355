"""Embeddings requests and responses (/v1/embeddings), as OpenAI's API and vLLM's pooling
server take and give them: interactive and as batch lines alike.

An embedding is one engine pass over the input, with nothing generated: it is never
preempted part way (a batch item of embeddings yields, queues and resumes whole, by
item), and it costs its prompt tokens alone. Served by engine workers whose model runs in
vLLM's pooling mode (BALLAST_MODEL_TASK=embed); a generating model serves none, and an
embedding model no chat or completions.

Accepted: `input` (a text, token ids, or a list of either, up to MAX_INPUTS), `model`,
`encoding_format` (float, or base64 of little-endian float32 as vLLM and OpenAI's client
read it), `dimensions` (where the model has Matryoshka embeddings: vLLM decides), `user`,
and vLLM's `add_special_tokens`. Anything else is a 400 naming the parameter.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from protocol.errors import ProtocolError
from protocol.requests import EMBEDDINGS, Invalid, RequestLimits, unstorable

MAX_INPUTS = 2048  # inputs in one request: OpenAI's maximum
ENCODINGS = ("float", "base64")
PARAMS = ("model", "input", "encoding_format", "dimensions", "user", "add_special_tokens")

Input = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[Input, ...]
    base64: bool = False  # encoding_format
    dimensions: int | None = None
    add_special_tokens: bool = True  # vLLM's default for embeddings
    endpoint: str = EMBEDDINGS
    service_tier: str = "default"  # embeddings have no tier of their own: the tenant's default

    @property
    def n(self) -> int:
        """vLLM requests it makes: one per input (its load, as placement and slots count it)."""
        return len(self.inputs)


def parse(body: Any, limits: RequestLimits) -> EmbeddingRequest | ProtocolError:
    """The request, or why it cannot run (never an exception, whatever `body` holds)."""
    try:
        return _parse(body, limits)
    except Invalid as e:
        return ProtocolError(e.status, e.code, e.message, e.param)


def _parse(body: Any, limits: RequestLimits) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise Invalid("The request body must be a JSON object.", "invalid_request")
    unstorable(body)
    for name in body:
        if name not in PARAMS:
            raise Invalid(f"Unrecognized request argument supplied: {name}", "unknown_parameter", name)
    model = body.get("model")
    if model is None:
        raise Invalid("`model` is required.", "missing_required_parameter", "model")
    if not isinstance(model, str):
        raise Invalid("`model` must be a string.", "invalid_type", "model")
    if model != limits.model:
        served = ", ".join(repr(m) for m in sorted((limits.model, *limits.others)))
        raise Invalid(f"The model {model!r} does not exist; this deployment serves {served}.", "model_not_found",
                      "model", 404)
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise Invalid("`encoding_format` must be 'float' or 'base64'.", "invalid_value", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        whole = _ids([dimensions])
        if whole is None or whole[0] < 1:
            raise Invalid("`dimensions` must be an integer >= 1.", "invalid_value", "dimensions")
        dimensions = whole[0]
    for name in ("user",):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise Invalid(f"`{name}` must be a string.", "invalid_type", name)
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise Invalid("`add_special_tokens` must be a boolean.", "invalid_type", "add_special_tokens")
    return EmbeddingRequest(model, _inputs(body.get("input")), encoding == "base64", dimensions, special is not False)


def _inputs(value: Any) -> tuple[Input, ...]:
    """A text, token ids, a list of texts or a list of token-id lists (OpenAI's four forms)."""
    if value is None:
        raise Invalid("`input` is required.", "missing_required_parameter", "input")
    if isinstance(value, str) or _ids(value) is not None:
        value = [value]
    if not isinstance(value, list) or not value:
        raise Invalid("`input` must be a string, a list of token ids, or a non-empty list of either.",
                      "invalid_type", "input")
    if len(value) > MAX_INPUTS:
        raise Invalid(f"`input` holds {len(value)} inputs; at most {MAX_INPUTS} are allowed in one request.",
                      "invalid_value", "input")
    out: list[Input] = []
    for i, one in enumerate(value):
        ids = _ids(one)
        if isinstance(one, str) and one:
            out.append(one)
        elif ids is not None:
            if min(ids) < 0:
                raise Invalid(f"`input[{i}]` holds a negative token id.", "invalid_value", "input")
            out.append(ids)
        else:
            raise Invalid(f"`input[{i}]` must be a non-empty string (OpenAI refuses an empty one) or a non-empty "
                          "list of token ids.", "invalid_value", "input")
    if len({isinstance(one, str) for one in out}) > 1:
        raise Invalid("`input` mixes texts and token-id lists; send one kind per request.", "invalid_value", "input")
    return tuple(out)


def _ids(value: Any) -> tuple[int, ...] | None:
    """Token ids as JSON Schema reads integers (5 or 5.0, never true); None: not a list of them."""
    if not isinstance(value, list) or not value:
        return None
    ids = [t if isinstance(t, int) else int(t) if isinstance(t, float) and t.is_integer() else None
           for t in value if not isinstance(t, bool)]
    return tuple(ids) if len(ids) == len(value) and None not in ids else None  # type: ignore[arg-type]


def wrong_task(model: str, embeds: bool, endpoint: str) -> ProtocolError | None:
    """An embedding model serves embeddings alone, a generating one everything else."""
    if embeds and endpoint != EMBEDDINGS:
        return ProtocolError(400, "invalid_request", f"The model {model!r} is an embedding model: it serves "
                             f"{EMBEDDINGS} only, not {endpoint}.", "model")
    if not embeds and endpoint == EMBEDDINGS:
        return ProtocolError(400, "invalid_request", f"The model {model!r} generates text: it serves no embeddings. "
                             "Ask an embedding model (one whose engine workers run BALLAST_MODEL_TASK=embed).",
                             "model")
    return None


# -- what the engine checks with its tokenizer --------------------------------------


def check_lengths(lengths: list[int], max_model_len: int) -> ProtocolError | None:
    """Every input must fit the model's context, as vLLM requires."""
    for i, n in enumerate(lengths):
        if n > max_model_len:
            return ProtocolError(400, "context_length_exceeded",
                                 f"This model's maximum context length is {max_model_len} tokens. However, input "
                                 f"{i} has {n} tokens. Please reduce the length of the input.", "input")
    return None


# -- the response -------------------------------------------------------------------


def encoded(vector: list[float], as_base64: bool) -> list[float] | str:
    """One embedding as the request asked: floats, or base64 of little-endian float32 (the
    engine's values are float32, so nothing is lost either way)."""
    if not as_base64:
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def response(model: str, vectors: list[list[float]], prompt_tokens: int, as_base64: bool) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse."""
    data = [dict(object="embedding", index=i, embedding=encoded(v, as_base64)) for i, v in enumerate(vectors)]
    return dict(object="list", model=model, data=data,
                usage=dict(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
