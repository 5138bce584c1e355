"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": dict(message=message, type=error_type(status), param=param, code=code)}


@dataclass(frozen=True)
class ProtocolError:
    """Why a request cannot run: a 4xx answer, or a batch item's error-file entry."""

    status_code: int
    code: str
    message: str
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param, self.code)

    def at_line(self, line: int) -> ProtocolError:
        return ProtocolError(self.status_code, self.code, f"Line {line}: {self.message}", self.param)


def bad_char(text: str) -> str | None:
    """What of `text` Postgres cannot hold (NUL anywhere, lone surrogates in JSONB, which
    are not UTF-8 at all), described for an error message; None when it can hold it all."""
    if "\x00" in text:
        return "The NUL character (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "A lone surrogate (\\ud800-\\udfff)"
    return None


def storable(text: str, limit: int | None = 1000) -> str:
    """Text safe to keep in Postgres and to send as UTF-8: NUL and lone surrogates shown
    escaped, bounded. For messages that may quote what a client sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\u0000")[:limit]
