"""Every error leaves the API in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException

from journal.db import unreachable
from protocol.errors import ProtocolError, bad_char, error_type, storable

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @classmethod
    def of(cls, e: ProtocolError) -> APIError:
        """A request's refusal as `protocol` states it (parse, a model's task), as the API answers it."""
        return cls(e.status_code, e.message, param=e.param, code=e.code)


def not_found(kind: str, id: str, param: str | None = None) -> APIError:
    shown = id if len(id) <= 128 else id[:64] + "…"
    return APIError(404, f"No {kind} found with id '{shown}'.", param=param, code="not_found")


# -- client text on its way to Postgres -----------------------------------------------
# A text column refuses NUL and JSONB refuses NUL and lone surrogates (which are not UTF-8
# at all): caught here they are a 400 or a 404, at the database they were a 500.

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def possible_id(value: str) -> bool:
    """Whether `value` could be one of our ids (`file-…`, `batch_…`, …). One that cannot is
    simply unknown, answered without asking the database."""
    return _ID.fullmatch(value) is not None


def require_id(kind: str, id: str, param: str) -> None:
    if not possible_id(id):
        raise not_found(kind, id, param)


def check_text(value: str, param: str, what: str | None = None) -> str:
    """`value` if Postgres can hold it as text or inside JSONB, else a 400 naming `param`."""
    if bad := bad_char(value):
        raise APIError(400, f"{bad} is not allowed in {what or param}.", param=param, code="invalid_value")
    return value


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's metadata rules (at most 16 pairs: the request model bounds that): keys up
    to 64 characters, values up to 512, text Postgres can hold."""
    for k, v in (metadata or {}).items():
        check_text(k, "metadata", "metadata keys")
        check_text(v, "metadata", "metadata values")
        if len(k) > 64 or len(v) > 512:
            raise APIError(400, "metadata keys are at most 64 characters and values at most 512.", param="metadata",
                           code="invalid_value")


def _utf8(text: str | None) -> str | None:
    # Messages and params may quote client text: a lone surrogate is shown escaped, not
    # sent as bytes that are not UTF-8.
    return None if text is None else storable(text, limit=None)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": dict(message=_utf8(message), type=error_type(status), param=_utf8(param), code=code)}
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
        param = ".".join(loc) or None
        message = first.get("msg", "Invalid request.")
        if first.get("type") == "json_invalid":
            message, param = "The request body is not valid JSON.", None
        return error_response(400, f"{message}" + (f" (param: {param})" if param else ""), param, "invalid_request")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), None, None)

    @app.exception_handler(DBAPIError)
    async def _database(_: Request, e: DBAPIError):
        if unreachable(e):  # Postgres restarting: say when to come back, not "server error"
            log.warning("the database is unreachable: %s", type(e.orig).__name__ if e.orig else e)
            return error_response(503, "The service's database is unreachable right now; try again shortly.", None,
                                  "unavailable", {"Retry-After": "5"})
        log.exception("database error")
        return error_response(500, "The server had an error while processing your request.", None, "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, "The server had an error while processing your request.", None, "server_error")
