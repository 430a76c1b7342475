"""OpenAI-shaped error bodies and the app's exception handlers.

Every error the server answers is ``{"error": {"message", "type", "param", "code"}}``:
``param`` names the request field at fault (or ``null``), ``code`` is a short string.
4xx messages say what the client did wrong; 5xx messages are generic and carry the
request id, while the detail (worker PIDs, exception text) goes to the log only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.errors import (
    EngineDeadError,
    EngineNotStartedError,
    EngineOverloaded,
    InvalidRequestError,
    KvstepError,
)
from pipeline.logger import get_logger

__all__ = [
    "HTTPProblem",
    "UnsupportedFieldError",
    "error_body",
    "error_response",
    "exception_handlers",
    "request_id",
    "short_value",
]

_log = get_logger()
_MAX_MESSAGE = 500
# InvalidRequestError.what values that are not request fields, and the field they are about.
_PARAM_OF = {"token id": "prompt", "prompt length": "prompt", "body": None, "params": None}
_STARLETTE_KINDS = {
    404: ("not_found_error", "not_found"),
    405: ("method_not_allowed_error", "method_not_allowed"),
}


class HTTPProblem(KvstepError):
    """A request the server refuses with ``status`` before it reaches the engine.

    Attributes:
        status: The HTTP status (401, 408, 413, 415, ...).
        kind: The OpenAI error ``type``.
        code: The error ``code`` string.
        param: The request field at fault, or ``None``.
        headers: Extra response headers (``Connection: close`` for an unread body).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        super().__init__(message)


class UnsupportedFieldError(InvalidRequestError):
    """A request field kvstep knows of but does not implement yet (a 400 naming it)."""

    def __init__(self, field: str, value: object) -> None:
        super().__init__(field, value, "is not supported yet by kvstep; leave it out")


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    kind: str,
    code: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A JSON error response (see :func:`error_body`)."""
    body = error_body(message, kind, code, param)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def arrival_time(request: Request) -> float | None:
    """When the guard middleware received this HTTP request (``time.monotonic()``), or
    ``None`` outside it: the arrival time of the engine requests it makes, so that
    queue time and TTFT include reading, parsing and tokenizing the body."""
    value = request.scope.get("state", {}).get("kvstep_arrival")
    return value if isinstance(value, float) else None


def note_ignored_fields(request: Request, names: tuple[str, ...]) -> None:
    """Have the guard middleware name ``names`` (a body's ignored fields) in the
    response's ``X-Kvstep-Ignored-Fields`` header."""
    if names:
        request.scope.setdefault("state", {})["kvstep_ignored_fields"] = names


def ignored_fields_header(names: object) -> bytes | None:
    """The ``X-Kvstep-Ignored-Fields`` value of ``names``: at most 20, comma-separated,
    each escaped to printable ASCII (JSON string escapes; no control character can end
    the header), then ``... (N more)``; ``None`` when there are none."""
    if not isinstance(names, tuple) or not names:
        return None
    shown = [json.dumps(str(name)[:64])[1:-1].replace(",", "\\u002c") for name in names[:20]]
    if len(names) > 20:
        shown.append(f"... ({len(names) - 20} more)")
    return ", ".join(shown).encode("ascii")


def request_id(request: Request) -> str:
    """The id the guard middleware gave this HTTP request (``-`` outside it)."""
    rid: str = request.scope.get("state", {}).get("kvstep_request_id", "-")
    return rid


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequestError)
    code = "unsupported_field" if isinstance(exc, UnsupportedFieldError) else "invalid_value"
    param = _PARAM_OF.get(exc.what, exc.what)
    return error_response(400, str(exc), "invalid_request_error", code, param)


async def _overloaded(request: Request, exc: Exception) -> Response:
    _log.debug("request_refused_overloaded", request_id=request_id(request), error=str(exc))
    message = f"the server is overloaded; retry later (request id {request_id(request)})"
    return error_response(429, message, "overloaded_error", "overloaded")


async def _engine_dead(request: Request, exc: Exception) -> Response:
    _log.error("request_failed_engine_unavailable", request_id=request_id(request), error=str(exc))
    message = f"the engine is unavailable (request id {request_id(request)})"
    return error_response(503, message, "service_unavailable_error", "engine_unavailable")


async def _problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPProblem)
    return error_response(exc.status, str(exc), exc.kind, exc.code, exc.param, exc.headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind, code = _STARLETTE_KINDS.get(exc.status_code, ("invalid_request_error", "http_error"))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(exc.status_code, message, kind, code, headers=exc.headers)


Handler = Callable[[Request, Exception], Awaitable[Response]]


def exception_handlers() -> dict[Any, Handler]:
    """The app's handlers: bad input 400, overload 429, dead engine 503, HTTP errors."""
    return {
        InvalidRequestError: _invalid_request,
        EngineOverloaded: _overloaded,
        EngineDeadError: _engine_dead,
        EngineNotStartedError: _engine_dead,
        HTTPProblem: _problem,
        HTTPException: _http_exception,
    }


def short_value(value: object) -> object:
    """``value`` or a stand-in short enough for an error message."""
    if isinstance(value, str):
        return value if len(value) <= 40 else value[:40] + "..."
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) < 10**30 else f"<{value.bit_length()}-bit integer>"
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)}>"
    return value
