"""Reading a JSON request body under a size cap, a deadline and a strict parser.

The cap is enforced as the body streams in (a ``Content-Length`` above it is refused
before reading; a lying or chunked body is cut off at the first byte past it), the
whole read runs under ``body_timeout_s``, and the parser refuses what Python's ``json``
accepts but JSON does not (``NaN``, ``Infinity``, numbers that overflow a float). Bodies
above ``INLINE_PARSE_BYTES`` are parsed on a worker thread so a large or deeply nested
body never stalls the event loop; small ones parse inline, where a thread hop would
cost more than the parse.
"""

from __future__ import annotations

import json
import math
from typing import NoReturn

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pipeline.errors import InvalidRequestError
from pipeline.logger import get_logger
from pipeline.server.errors import HTTPProblem, request_id
from pipeline.server.options import ServerOptions

_log = get_logger()

__all__ = [
    "CLIENT_CLOSED",
    "INLINE_PARSE_BYTES",
    "ClientGone",
    "parse_json",
    "read_body",
    "read_json",
]

INLINE_PARSE_BYTES = 16 * 1024
_CLOSE = {"Connection": "close"}


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_json(
    request: Request, options: ServerOptions, limiter: anyio.CapacityLimiter
) -> object:
    """The request's JSON body, decoded.

    Raises:
        HTTPProblem: 415 (not ``application/json``), 413 (over ``max_body_bytes``), 408
            (not received within ``body_timeout_s``).
        InvalidRequestError: The body is not (strict) JSON, or nests too deeply.
        ClientGone: The client disconnected mid-body.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise HTTPProblem(
            415,
            f"the body must be JSON sent as Content-Type: application/json, not {media_type!r}",
            code="unsupported_media_type",
            param="Content-Type",
        )
    cap = options.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        _too_large(cap)
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(options.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    _too_large(cap)
                chunks.append(chunk)
    except TimeoutError:
        raise HTTPProblem(
            408,
            f"the request body did not arrive within {options.body_timeout_s:g} s",
            code="request_timeout",
            headers=_CLOSE,
        ) from None
    except ClientDisconnect:
        raise ClientGone() from None
    raw = b"".join(chunks)
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_json(raw)
    return await anyio.to_thread.run_sync(parse_json, raw, limiter=limiter)


def parse_json(raw: bytes) -> object:
    """Decode ``raw`` as strict JSON; ``InvalidRequestError`` (``body``) otherwise."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidRequestError("body", "<nested>", "must not nest this deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an int past 4300 digits
        raise InvalidRequestError("body", "<not JSON>", f"must be a JSON object ({exc})") from None


def _too_large(cap: int) -> NoReturn:
    raise HTTPProblem(
        413,
        f"the request body is larger than the server's limit of {cap} bytes",
        code="body_too_large",
        headers=_CLOSE,
    )


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


CLIENT_CLOSED = 499  # nginx's "client closed request": never seen by the client


async def read_body(request: Request) -> object | Response:
    """The route's JSON body under the app's limits, or the 499 response to return when
    the client disconnected mid-body (logged as one line, never a traceback).

    Raises:
        HTTPProblem: As :func:`read_json`.
    """
    state = request.app.state.kvstep
    try:
        return await read_json(request, state.options, state.parse_limiter)
    except ClientGone:
        _log.info("client_disconnected_mid_body", request_id=request_id(request))
        return Response(status_code=CLIENT_CLOSED)
