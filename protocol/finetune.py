"""Fine-tuning training files (OpenAI's JSONL), checked before any step trains.

Each line is one example, all of one format:
- chat: {"messages": [{"role", "content", "weight"?}, …]}: roles system, user, assistant
  (tool messages are not trained on and not accepted here); at least one assistant
  message; `weight` (0 or 1, assistant messages only) says whether it is trained;
- prompt/completion: {"prompt": str, "completion": str}.

Every problem names its line, as OpenAI's validation does; a file with any is refused
whole (nothing trains on half a file). Token counts are checked by the caller, which
holds the tokenizer (`too_long`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from protocol.batch import MAX_ERRORS, LineError, json_object
from protocol.errors import bad_char

ROLES = ("system", "user", "assistant")
MIN_EXAMPLES = 10  # as OpenAI
MAX_EXAMPLES = 100_000

Format = Literal["chat", "prompt_completion"]


@dataclass(frozen=True)
class Row:
    line: int
    format: Format
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str = ""
    completion: str = ""


def rows(lines: Iterable[bytes], min_examples: int = MIN_EXAMPLES) -> Iterator[Row | LineError]:
    """The examples and the problems, in line order; then, if the file is too short or
    mixes formats, a problem for the file (line 0, or the first line of the odd format)."""
    count = 0
    first: dict[Format, int] = {}  # each format's first line
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if count >= MAX_EXAMPLES:
            yield LineError(n, "too_many_examples", f"A training file may hold at most {MAX_EXAMPLES} examples.")
            return
        got = _row(n, raw)
        if isinstance(got, Row):
            first.setdefault(got.format, n)
            if len(first) > 1:
                yield LineError(n, "mixed_formats", "Every example must have the same format: this line is "
                                f"{got.format.replace('_', '/')}, line {min(first.values())} is not.")
                return
            count += 1
        yield got
    if count < min_examples:
        yield LineError(0, "too_few_examples",
                        f"Training file has {count} example(s), but must have at least {min_examples} examples.")


def problems(lines: Iterable[bytes], min_examples: int = MIN_EXAMPLES) -> list[LineError]:
    """The file's first MAX_ERRORS problems; none: it can be trained on."""
    out = []
    for got in rows(lines, min_examples):
        if isinstance(got, LineError):
            out.append(got)
            if len(out) >= MAX_ERRORS:
                break
    return out


def _row(n: int, raw: bytes) -> Row | LineError:
    obj = json_object(n, raw)
    if isinstance(obj, LineError):
        return obj
    if "messages" in obj:
        return _chat(n, obj["messages"])
    if "prompt" in obj or "completion" in obj:
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            return LineError(n, "invalid_example", "A prompt/completion example needs a string prompt and a "
                             "non-empty string completion.")
        if why := bad_char(prompt + completion):
            return LineError(n, "unsupported_character", f"{why} cannot be trained on.")
        return Row(n, "prompt_completion", prompt=prompt, completion=completion)
    return LineError(n, "invalid_example", "Each example needs `messages` (chat) or `prompt` and `completion`.")


def _chat(n: int, messages: Any) -> Row | LineError:
    if not isinstance(messages, list) or not messages:
        return LineError(n, "invalid_example", "`messages` must be a non-empty list.", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            return LineError(n, "invalid_example", f"{where} must be an object.", where)
        if m.get("role") not in ROLES:
            return LineError(n, "invalid_role", f"{where}.role must be one of {', '.join(ROLES)}; got "
                             f"{json.dumps(m.get('role'))[:40]}.", f"{where}.role")
        if not isinstance(m.get("content"), str):
            return LineError(n, "invalid_example", f"{where}.content must be a string.", f"{where}.content")
        if why := bad_char(m["content"]):
            return LineError(n, "unsupported_character", f"{why} cannot be trained on ({where}.content).",
                             f"{where}.content")
        if "weight" in m and (m["role"] != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool)):
            return LineError(n, "invalid_weight", f"{where}.weight must be 0 or 1, on assistant messages only.",
                             f"{where}.weight")
        if set(m) - {"role", "content", "weight", "name"}:
            extra = sorted(set(m) - {"role", "content", "weight", "name"})[0]
            return LineError(n, "invalid_example", f"{where} has an unsupported key {extra!r}.", where)
    if not any(m["role"] == "assistant" for m in messages):
        return LineError(n, "no_assistant_message", "Each example must contain at least one assistant message.",
                         "messages")
    if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
        return LineError(n, "nothing_to_train", "Every assistant message of this example has weight 0.", "messages")
    return Row(n, "chat", messages=tuple(messages))
