"""Response shapes: completions and chat completions, whole or as stream chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol import logprobs as lp
from protocol.errors import error_body
from protocol.requests import CHAT


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """`cached_tokens`: prompt tokens the engine found in its prefix cache, where known."""
    out: dict[str, Any] = dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                               total_tokens=prompt_tokens + completion_tokens)
    if cached_tokens is not None:
        out["prompt_tokens_details"] = dict(cached_tokens=cached_tokens)
    return out


@dataclass(frozen=True)
class Choice:
    """One of a whole response's choices. `logprobs`: shaped (protocol/logprobs.py).
    `tool_calls`: what the model's tool parser read in its output (`text` is then what
    else it said, if anything)."""

    text: str | None
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None


def completion(endpoint: str, meta: dict[str, Any], choices: list[Choice], prompt_tokens: int,
               completion_tokens: int, *, cached_tokens: int | None = None) -> dict[str, Any]:
    """A whole response; `meta` holds id, created, model (and service_tier where served);
    `completion_tokens` counts every choice's."""
    shaped = []
    for index, c in enumerate(choices):
        if endpoint == CHAT:
            message: dict[str, Any] = dict(role="assistant", content=c.text)
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            shaped.append(dict(index=index, message=message, finish_reason=c.finish_reason, logprobs=c.logprobs))
        else:
            shaped.append(dict(index=index, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs))
    obj = "chat.completion" if endpoint == CHAT else "text_completion"
    return dict(meta, object=obj, choices=shaped, usage=usage(prompt_tokens, completion_tokens, cached_tokens))


def shaped_logprobs(endpoint: str, positions: list[lp.Decoded] | None, top: int | None) -> dict[str, Any] | None:
    """A whole choice's logprobs from its decoded alternatives (None: not asked for)."""
    if positions is None or top is None:
        return None
    return lp.chat(positions, top) if endpoint == CHAT else lp.completion(positions, top)


class Chunks:
    """Server-sent events of one streamed response (of its choice `index`), in OpenAI's
    shape. `top`: the alternatives per token the request asked for (None: no logprobs)."""

    def __init__(self, endpoint: str, meta: dict[str, Any], top: int | None = None, index: int = 0):
        self.index = index  # the choice these chunks are of
        self.chat = endpoint == CHAT
        self.meta = meta
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.top = top
        self._offset = 0  # completions: the text offset of the next chunk's first token

    def start(self) -> bytes | None:
        """Chat streams open with the assistant's role; completions have no such chunk."""
        return self._event([self._choice("", None, first=True)]) if self.chat else None

    def text(self, delta: str, positions: list[lp.Decoded] | None = None) -> bytes:
        return self._event([self._choice(delta, None, logprobs=self._logprobs(positions))])

    def message(self, delta: dict[str, Any], positions: list[lp.Decoded] | None = None) -> bytes | None:
        """A chat delta as a tool parser made it ({content?, tool_calls?}); None where it
        holds everything back and there are no logprobs to send."""
        logprobs = self._logprobs(positions)
        if not delta and logprobs is None:
            return None
        return self._event([dict(index=self.index, delta=delta, finish_reason=None, logprobs=logprobs)])

    def finish(self, reason: str) -> bytes:
        return self._event([self._choice(None, reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        return self._event([], usage=usage(prompt_tokens, completion_tokens, cached_tokens))

    def _logprobs(self, positions: list[lp.Decoded] | None) -> dict[str, Any] | None:
        if self.top is None or positions is None:
            return None
        if self.chat:
            return dict(content=lp.chat_content(positions, self.top), refusal=None)
        shaped = lp.completion(positions, self.top, self._offset)
        if positions:
            self._offset = lp.next_offset(shaped)
        return shaped

    @staticmethod
    def error(status: int, message: str, code: str | None = None) -> bytes:
        """A failure mid-stream: an error event (as OpenAI sends one), then the end."""
        return _sse(error_body(status, message, None, code)) + done()

    def _choice(self, text: str | None, reason: str | None, first: bool = False,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return dict(index=self.index, delta=delta, finish_reason=reason, logprobs=logprobs)
        return dict(index=self.index, text=text or "", finish_reason=reason, logprobs=logprobs)

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _sse(dict(self.meta, object=self.object, choices=choices, **extra))


def done() -> bytes:
    return b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
