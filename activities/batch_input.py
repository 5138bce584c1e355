"""Reading a batch input file (OpenAI Batch API JSONL), line by line. Pure: no I/O.

Two kinds of problems, as OpenAI reports them:
- the file is unusable (a line is not JSON, a custom_id repeats, a url does not match the
  batch's endpoint...): the batch fails during validation with errors naming the lines;
- one request is invalid (max_tokens beyond the context, an unknown model, malformed
  messages): that request lands in the error file with a 4xx body, the rest still run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_ERRORS = 100  # OpenAI reports a bounded number of line errors, so do we


@dataclass(frozen=True)
class LineError:
    line: int
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict[str, Any]:
        return dict(code=self.code, message=self.message, param=self.param, line=self.line)


@dataclass(frozen=True)
class RequestError:
    """Why one request cannot run: becomes its error-file entry."""

    status_code: int
    code: str
    message: str
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": dict(message=self.message, type="invalid_request_error", param=self.param, code=self.code)}


@dataclass(frozen=True)
class Item:
    idx: int
    line: int
    custom_id: str
    body: dict[str, Any]
    error: RequestError | None = None


@dataclass(frozen=True)
class Limits:
    endpoint: str
    model: str
    max_model_len: int
    max_lines: int = 50_000


def parse(lines: Iterable[bytes], limits: Limits) -> tuple[list[Item], list[LineError]]:
    items: list[Item] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if len(items) >= limits.max_lines:
            errors.append(LineError(n, "too_many_requests", f"A batch may hold at most {limits.max_lines} requests."))
            break
        item = _parse_line(n, raw, len(items), limits, errors)
        if item is None:
            continue
        if item.custom_id in seen:
            errors.append(
                LineError(
                    n,
                    "duplicate_custom_id",
                    f"The custom_id {item.custom_id!r} is a duplicate of line {seen[item.custom_id]}; "
                    "custom_id must be unique for each request in a batch.",
                    "custom_id",
                )
            )
            continue
        seen[item.custom_id] = n
        items.append(item)
    if not items and not errors:
        errors.append(LineError(0, "empty_file", "The batch input file is empty."))
    return items, errors[:MAX_ERRORS]


def _parse_line(n: int, raw: bytes, idx: int, limits: Limits, errors: list[LineError]) -> Item | None:
    def bad(code: str, message: str, param: str | None = None) -> None:
        errors.append(LineError(n, code, message, param))

    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return bad("invalid_json_line", f"This line is not parseable as valid JSON: {e.msg if hasattr(e, 'msg') else e}.")
    if not isinstance(obj, dict):
        return bad("invalid_json_line", "Each line must be a JSON object.")
    if b"\\u0000" in raw:  # Postgres JSONB cannot store NUL characters
        return bad("unsupported_character", "NUL characters (\\u0000) are not supported in requests.")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_required_parameter", "Each request needs a non-empty string custom_id.", "custom_id")
    if obj.get("method") != "POST":
        return bad("invalid_method", "The method must be POST.", "method")
    if obj.get("url") != limits.endpoint:
        return bad(
            "mismatched_endpoint",
            f"The url {obj.get('url')!r} does not match the batch's endpoint {limits.endpoint!r}.",
            "url",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("missing_required_parameter", "Each request needs a JSON object body.", "body")
    return Item(idx, n, custom_id, body, check_request(limits.endpoint, body, limits, line=n))


def check_request(endpoint: str, body: dict[str, Any], limits: Limits, line: int | None = None,
                  interactive: bool = False) -> RequestError | None:
    """The checks that need no tokenizer. The engine adds prompt length + max_tokens."""
    where = f"Line {line}: " if line is not None else ""

    def err(message: str, param: str | None, code: str = "invalid_value", status: int = 400) -> RequestError:
        return RequestError(status, code, where + message, param)

    model = body.get("model")
    if not isinstance(model, str):
        return err("`model` is required.", "model", "missing_required_parameter")
    if model != limits.model:
        return err(f"The model {model!r} does not exist; this deployment serves {limits.model!r}.", "model",
                   "model_not_found")
    if endpoint == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(_is_message(m) for m in msgs):
            return err("`messages` must be a non-empty list of {role, content} objects.", "messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))):
            return err("`prompt` must be a string or a list of token ids.", "prompt")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return err(f"`{name}` must be an integer >= 1.", name)
        if value > limits.max_model_len:
            return err(
                f"`{name}` is {value}, beyond the model's context length of {limits.max_model_len} tokens.",
                name,
                "context_length_exceeded",
            )
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or not 0 <= t <= 2):
        return err("`temperature` must be between 0 and 2.", "temperature")
    if body.get("n", 1) != 1:
        return err("Only n=1 is supported.", "n", "unsupported_value")
    if body.get("stream") and not interactive:
        return err("Streaming is not available inside a batch.", "stream", "unsupported_value")
    return None


def _is_message(m: Any) -> bool:
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        return False
    c = m.get("content")
    return isinstance(c, str) or (
        isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c)
    )


def max_tokens(body: dict[str, Any]) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")


def message_text(m: dict[str, Any]) -> str:
    c = m["content"]
    return c if isinstance(c, str) else "".join(p["text"] for p in c)
