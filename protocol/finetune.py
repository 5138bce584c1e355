"""Fine-tuning training files (OpenAI's JSONL), checked before any step trains.

Each line is one example, all of one format:
- chat: {"messages": [{"role", "content", "weight"?}, …]}: roles system, user, assistant
  (tool messages are not trained on and not accepted here); at least one assistant
  message; `weight` (0 or 1, assistant messages only) says whether it is trained;
- prompt/completion: {"prompt": str, "completion": str}.

Every problem names its line, as OpenAI's validation does; a file with any is refused
whole (nothing trains on half a file). Token counts are checked by the caller, which
holds the tokenizer (`too_long`).

And the LoRA adapter a job trains: its rank, alpha and target modules, extensions to
OpenAI's hyperparameters (`lora_rank`, `lora_alpha`, `lora_target_modules`), their defaults
and what the API accepts (`lora_problem`); whether the model has the modules is known only
where it is loaded (training/trainer.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from protocol.batch import MAX_ERRORS, LineError, json_object
from protocol.errors import bad_char

ROLES = ("system", "user", "assistant")
MIN_EXAMPLES = 10  # as OpenAI
MAX_EXAMPLES = 100_000

Format = Literal["chat", "prompt_completion"]

# A job's LoRA adapter where it names none: rank 8 on the attention's q and v projections,
# the update scaled by alpha / rank = 2.
LORA_RANK = 8
LORA_ALPHA = 16.0
LORA_TARGETS = ("q_proj", "v_proj")
MAX_LORA_TARGETS = 64
# A module's name, or the end of its dotted path ("q_proj", "self_attn.q_proj"), as PEFT matches it.
_MODULE = re.compile(r"[A-Za-z0-9_]{1,128}(\.[A-Za-z0-9_]{1,128}){0,7}")


def lora_problem(name: str, value: object, max_rank: int) -> str | None:
    """What is wrong with a job's `lora_rank`, `lora_alpha` or `lora_target_modules`
    (`name`), None if nothing. A rank is a power of two up to `max_rank`, the largest the
    deployment's engines serve (their max_lora_rank)."""
    if name == "lora_rank":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            return f"lora_rank must be a power of two (1, 2, 4, 8, …); got {json.dumps(value)[:40]}."
        if value > max_rank:
            return (f"lora_rank {value} is more than this deployment's engines serve: LoRA ranks up to "
                    f"{max_rank}.")
        return None
    if name == "lora_alpha":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            return f"lora_alpha must be a number above 0; got {json.dumps(value)[:40]}."
        return None
    if name == "lora_target_modules":
        if (not isinstance(value, list) or not value or len(value) > MAX_LORA_TARGETS
                or not all(isinstance(m, str) and _MODULE.fullmatch(m) for m in value)):
            return (f"lora_target_modules must be a list of 1 to {MAX_LORA_TARGETS} module names (as "
                    "[\"q_proj\", \"v_proj\"]: letters, digits and '_', dotted paths allowed).")
        if len(set(value)) < len(value):
            return "lora_target_modules names a module twice."
        return None
    raise ValueError(f"not a LoRA hyperparameter: {name}")


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
