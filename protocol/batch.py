"""Batch input files (OpenAI Batch API JSONL), read as a stream, line by line.

Two kinds of problems, as OpenAI reports them:
- the file is unusable (a line is not JSON, a custom_id repeats, a url does not match the
  batch's endpoint...): the batch fails during validation with errors naming the lines;
- one request is invalid (anything `protocol.requests.parse` refuses): that request lands
  in the error file with its 4xx body and line number, the rest still run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from protocol import embeddings
from protocol.embeddings import EmbeddingRequest
from protocol.errors import ProtocolError
from protocol.requests import EMBEDDINGS, GenerationRequest, Invalid, RequestLimits, order_matters, parse, unstorable

MAX_ERRORS = 100  # OpenAI reports a bounded number of line errors, so do we
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class LineError:
    line: int
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict[str, Any]:
        return dict(code=self.code, message=self.message, param=self.param, line=self.line)


@dataclass(frozen=True)
class Item:
    idx: int
    line: int
    custom_id: str
    body: dict[str, Any]  # {} where the body cannot be stored (NUL, lone surrogates): `error` says why
    error: ProtocolError | None = None
    # The body as the line wrote it, where its keys' order matters (`order_matters`): the
    # journal's jsonb keeps keys in an order of its own.
    body_json: str | None = None


@dataclass(frozen=True)
class FileLimits:
    endpoint: str
    request: RequestLimits
    max_lines: int = 50_000


def scan(lines: Iterable[bytes], limits: FileLimits) -> Iterator[Item | LineError]:
    """Items and file-level errors in line order; holds only the custom_ids seen."""
    seen: dict[str, int] = {}
    count = 0
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if count >= limits.max_lines:
            yield LineError(n, "too_many_requests", f"A batch may hold at most {limits.max_lines} requests.")
            return
        got = _line(n, raw, count, limits)
        if isinstance(got, Item):
            if got.custom_id in seen:
                yield LineError(n, "duplicate_custom_id",
                                f"The custom_id {got.custom_id!r} is a duplicate of line {seen[got.custom_id]}; "
                                "custom_id must be unique for each request in a batch.", "custom_id")
                continue
            seen[got.custom_id] = n
            count += 1
        yield got
    if not count and not seen:
        yield LineError(0, "empty_file", "The batch input file is empty.")


def file_errors(lines: Iterable[bytes], limits: FileLimits) -> list[LineError]:
    """The first pass: whether the file is usable at all (first MAX_ERRORS problems)."""
    errors = []
    for got in scan(lines, limits):
        if isinstance(got, LineError):
            errors.append(got)
            if len(errors) >= MAX_ERRORS:
                break
    return errors


def json_object(n: int, raw: bytes) -> dict[str, Any] | LineError:
    """Line `n` of a JSONL file as a JSON object, or why it is not one."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return LineError(n, "invalid_json_line", f"This line is not parseable as valid JSON: {getattr(e, 'msg', e)}.")
    except RecursionError:
        return LineError(n, "invalid_json_line", "This line nests JSON too deeply.")
    if not isinstance(obj, dict):
        return LineError(n, "invalid_json_line", "Each line must be a JSON object.")
    return obj


def _line(n: int, raw: bytes, idx: int, limits: FileLimits) -> Item | LineError:
    obj = json_object(n, raw)
    if isinstance(obj, LineError):
        return obj
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(n, "missing_required_parameter", "Each request needs a non-empty string custom_id.",
                         "custom_id")
    try:
        unstorable(custom_id, "custom_id")
    except Invalid as e:
        return LineError(n, e.code, e.message, "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        return LineError(n, "invalid_value", f"custom_id is at most {MAX_CUSTOM_ID} characters.", "custom_id")
    if obj.get("method") != "POST":
        return LineError(n, "invalid_method", "The method must be POST.", "method")
    if obj.get("url") != limits.endpoint:
        return LineError(n, "mismatched_endpoint",
                         f"The url {_show(obj.get('url'))} does not match the batch's endpoint {limits.endpoint!r}.",
                         "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(n, "missing_required_parameter", "Each request needs a JSON object body.", "body")
    checked = parse_line(limits.endpoint, body, limits.request)
    if isinstance(checked, ProtocolError):
        keep = body if checked.code != "unsupported_character" else {}
        return Item(idx, n, custom_id, keep, checked.at_line(n))
    ordered = isinstance(checked, GenerationRequest) and order_matters(checked)
    return Item(idx, n, custom_id, body, body_json=json.dumps(body, ensure_ascii=False) if ordered else None)


def parse_line(endpoint: str, body: Any, limits: RequestLimits) -> GenerationRequest | EmbeddingRequest | ProtocolError:
    """A batch line's request, by the batch's endpoint."""
    if endpoint == EMBEDDINGS:
        return embeddings.parse(body, limits)
    return parse(endpoint, body, limits, batch=True)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)  # never echo unstorable text back
    return text if len(text) <= 80 else text[:77] + "..."
