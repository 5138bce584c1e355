"""OpenAI request bodies to engine inputs, and engine outputs back to OpenAI responses.

Shared by batch items and interactive requests so both render prompts and bodies alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from activities.batch_input import RequestError, max_tokens, message_text

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # a vLLM extension, handy for benchmarks


def prompt_ids(engine, endpoint: str, body: dict[str, Any]) -> list[int]:
    if endpoint == CHAT:
        return engine.render_chat([dict(role=m["role"], content=message_text(m)) for m in body["messages"]])
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else engine.render_text(prompt)


def sampling(body: dict[str, Any], prompt_len: int, max_model_len: int, where: str = "") -> Sampling | RequestError:
    """Sampling settings, or why the request cannot fit the model's context."""
    room = max_model_len - prompt_len
    wanted = max_tokens(body)
    if room < 1 or (wanted is not None and wanted > room):
        return RequestError(
            400,
            "context_length_exceeded",
            f"{where}This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + (wanted or 1)} tokens ({prompt_len} in the prompt, {wanted or 1} for the completion).",
            "max_tokens" if wanted else "messages",
        )
    stop = body.get("stop") or []
    return Sampling(
        max_tokens=wanted or room,
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        seed=body.get("seed"),
        stop=[stop] if isinstance(stop, str) else list(stop),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def finish(engine, token_ids: list[int], s: Sampling, engine_reason: str | None) -> tuple[str, str]:
    """The text and finish_reason of a (possibly resumed) generation, from all its tokens.

    Stop strings are applied to the whole text, so a stop string that straddles a resume
    point is still honoured.
    """
    text = engine.decode(token_ids)
    for stop in s.stop:
        cut = text.find(stop)
        if cut >= 0:
            return text[:cut], "stop"
    if token_ids and token_ids[-1] == engine.tokenizer.eos_token_id and not s.ignore_eos:
        return text, "stop"
    if len(token_ids) >= s.max_tokens:
        return text, "length"
    return text, "stop" if engine_reason in (None, "stop") else engine_reason


def response_body(endpoint: str, response_id: str, model: str, text: str, reason: str,
                  prompt_tokens: int, completion_tokens: int, created: int | None = None) -> dict[str, Any]:
    created = created or int(time.time())
    usage = dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
    if endpoint == CHAT:
        choice = dict(index=0, message=dict(role="assistant", content=text), finish_reason=reason, logprobs=None)
        return dict(id=f"chatcmpl-{response_id}", object="chat.completion", created=created, model=model,
                    choices=[choice], usage=usage)
    choice = dict(index=0, text=text, finish_reason=reason, logprobs=None)
    return dict(id=f"cmpl-{response_id}", object="text_completion", created=created, model=model,
                choices=[choice], usage=usage)
