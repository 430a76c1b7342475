"""The guard in front of every route: a request id, the API key, the drain, a generic 500.

A plain ASGI middleware (no body buffering): it names each HTTP request
(``X-Request-Id``), refuses a missing or wrong bearer key with 401 before the app reads
anything (``/health`` stays open for orchestrators), refuses new requests with 503
``server_draining`` while the server drains for shutdown and counts the others in flight
(:class:`~pipeline.server.drain.Drain`), and turns an exception no handler took into a
generic 500 that carries the request id, the traceback going to the log.
"""

from __future__ import annotations

import hmac
import itertools
import os
import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.logger import get_logger
from pipeline.server.drain import RETRY_AFTER_S, Drain
from pipeline.server.errors import error_response, ignored_fields_header

__all__ = ["GuardMiddleware"]

_log = get_logger()
_OPEN_PATHS = frozenset({"/health"})


class GuardMiddleware:
    """Request ids, bearer-key auth, the drain and the last-resort 500 (see the module doc).

    Args:
        app: The wrapped ASGI app.
        api_key: The key as bytes, or ``None`` for no authentication.
        drain: The server's drain, or ``None`` (no 503 while draining, nothing counted).
    """

    def __init__(self, app: ASGIApp, api_key: bytes | None = None, drain: Drain | None = None):
        self.app = app
        self._key = api_key
        self._drain = drain
        self._prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)

    def __repr__(self) -> str:  # the key never shows
        return f"GuardMiddleware(auth={'on' if self._key is not None else 'off'})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"{self._prefix}-{next(self._ids)}"
        state = scope.setdefault("state", {})
        state["kvstep_request_id"] = rid
        state["kvstep_arrival"] = time.monotonic()  # the engine requests' arrival_time
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode()))
                ignored = ignored_fields_header(state.get("kvstep_ignored_fields"))
                if ignored is not None:
                    headers.append((b"x-kvstep-ignored-fields", ignored))
                message = {**message, "headers": headers}
            await send(message)

        if not self._authorized(scope):
            response = error_response(
                401,
                "a valid API key is required: Authorization: Bearer <key>",
                "authentication_error",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send_with_id)
            return
        drain, path = self._drain, _route_path(scope)
        if drain is not None and not drain.admits(path):
            drain.refused()
            response = error_response(
                503,
                "the server is shutting down (draining); retry the request on another server",
                "service_unavailable_error",
                "server_draining",
                headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
            )
            await response(scope, receive, send_with_id)
            return
        try:
            if drain is None or not drain.tracks(path):
                await self.app(scope, receive, send_with_id)
            else:
                with drain.track():  # counted in flight; the drain's end may cut it
                    await self.app(scope, receive, send_with_id)
        except Exception as exc:
            _log_internal_error(rid, scope, exc)
            if started:
                raise  # the response is half sent: the server closes the connection
            message = f"internal server error (request id {rid})"
            response = error_response(500, message, "internal_server_error", "internal_error")
            await response(scope, receive, send_with_id)

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None or _route_path(scope) in _OPEN_PATHS:
            return True
        value = Headers(scope=scope).get("authorization", "")
        scheme, _, given = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given_bytes = given.strip().encode("latin-1")  # as the header was decoded
        return hmac.compare_digest(given_bytes, self._key)


def _log_internal_error(rid: str, scope: Scope, exc: Exception) -> None:
    path = str(scope.get("path", ""))[:200].encode("utf-8", "backslashreplace").decode()
    fields = {"request_id": rid, "path": path}
    try:
        _log.error("request_failed_internal", error=repr(exc), exc_info=exc, **fields)
    except Exception:  # a log sink that cannot print the traceback (lone surrogates, ...)
        _log.error("request_failed_internal", error=ascii(exc)[:2000], **fields)


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path or "/"
