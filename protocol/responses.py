"""Response shapes: completions and chat completions, whole or as stream chunks."""

from __future__ import annotations

import json
from typing import Any

from protocol.errors import error_body
from protocol.requests import CHAT


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def completion(endpoint: str, meta: dict[str, Any], text: str, finish_reason: str, prompt_tokens: int,
               completion_tokens: int) -> dict[str, Any]:
    """A whole response; `meta` holds id, created, model (and service_tier where served)."""
    if endpoint == CHAT:
        choice = dict(index=0, message=dict(role="assistant", content=text), finish_reason=finish_reason, logprobs=None)
        obj = "chat.completion"
    else:
        choice = dict(index=0, text=text, finish_reason=finish_reason, logprobs=None)
        obj = "text_completion"
    return dict(meta, object=obj, choices=[choice], usage=usage(prompt_tokens, completion_tokens))


class Chunks:
    """Server-sent events of one streamed response, in OpenAI's shape."""

    def __init__(self, endpoint: str, meta: dict[str, Any]):
        self.chat = endpoint == CHAT
        self.meta = meta
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def start(self) -> bytes | None:
        """Chat streams open with the assistant's role; completions have no such chunk."""
        return self._event([self._choice("", None, first=True)]) if self.chat else None

    def text(self, delta: str) -> bytes:
        return self._event([self._choice(delta, None)])

    def finish(self, reason: str) -> bytes:
        return self._event([self._choice(None, reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event([], usage=usage(prompt_tokens, completion_tokens))

    @staticmethod
    def error(status: int, message: str, code: str | None = None) -> bytes:
        """A failure mid-stream: an error event (as OpenAI sends one), then the end."""
        return _sse(error_body(status, message, None, code)) + done()

    def _choice(self, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return dict(index=0, delta=delta, finish_reason=reason, logprobs=None)
        return dict(index=0, text=text or "", finish_reason=reason, logprobs=None)

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _sse(dict(self.meta, object=self.object, choices=choices, **extra))


def done() -> bytes:
    return b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
