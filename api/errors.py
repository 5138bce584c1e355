"""Every error leaves the API in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def not_found(kind: str, id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No {kind} found with id '{id}'.", param=param, code="not_found")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": dict(message=message, type=_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                          param=param, code=code)}
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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, "The server had an error while processing your request.", None, "server_error")
