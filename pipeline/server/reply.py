"""A non-streaming response's JSON body, built and written off the event loop when large.

A response with prompt logprobs (thousands of objects per prompt token) or with many
logprobs took the loop's thread for tens to hundreds of milliseconds per request to
build and encode, and a few dozen of them kept ``/health`` waiting for seconds. Such a
body is built and encoded on a worker thread (the app's ``parse_limiter``), and encoded
in pieces (:func:`dumps`): ``json.dumps`` holds the GIL for the whole of one call, so one
call over a megabyte would still stop the loop; pieces of a few dozen entries each let
it run between them. Small bodies are built inline, where a thread hop would cost more.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from starlette.responses import Response

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["OFF_LOOP_ENTRIES", "dumps", "json_reply"]

#: Logprob entries (tokens times alternatives) above which a body is built off the loop.
OFF_LOOP_ENTRIES = 4096
_PIECE = 64  # list entries encoded per json.dumps call, deep in a body
_FLAT_PIECE = 8192  # numbers or strings encoded per call (a token id list)
_DEEP = 3  # below this depth dicts and lists of containers are walked, not encoded whole


def _encode(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def dumps(value: Any) -> bytes:
    """``value`` as the compact UTF-8 JSON Starlette's ``JSONResponse`` writes, byte for
    byte, encoded in pieces so that no one ``json.dumps`` call covers much of it.

    Raises:
        ValueError: ``value`` holds NaN or an infinity (as ``JSONResponse``).
        TypeError: ``value`` holds something JSON cannot encode.
    """
    out: list[str] = []
    _pieces(value, out, 0)
    return "".join(out).encode("utf-8")


def _pieces(value: object, out: list[str], depth: int) -> None:
    if isinstance(value, dict) and depth <= _DEEP and all(type(k) is str for k in value):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(f"{',' if i else ''}{_encode(key)}:")
            _pieces(item, out, depth + 1)
        out.append("}")
    elif isinstance(value, list) and value:
        out.append("[")
        nested = any(isinstance(item, dict | list) for item in value)
        if depth < _DEEP and nested:
            for i, item in enumerate(value):
                if i:
                    out.append(",")
                _pieces(item, out, depth + 1)
        else:
            piece = _PIECE if nested else _FLAT_PIECE
            for i in range(0, len(value), piece):
                out.append(("," if i else "") + _encode(value[i : i + piece])[1:-1])
        out.append("]")
    else:
        out.append(_encode(value))


async def json_reply(
    state: ServerState, build: Callable[[], dict[str, Any]], *, entries: int
) -> Response:
    """The 200 JSON response of ``build()``: built and encoded on a worker thread when
    the body holds more than :data:`OFF_LOOP_ENTRIES` logprob ``entries``, else inline.

    ``build`` must not touch what the loop may change meanwhile (it sees the finished
    requests' last outputs only). Not cancellable once on the thread: the body is
    finished and dropped if the client has gone.
    """
    if entries <= OFF_LOOP_ENTRIES:
        return Response(_encode(build()).encode("utf-8"), media_type="application/json")

    def render() -> bytes:
        return dumps(build())

    body = await anyio.to_thread.run_sync(render, limiter=state.parse_limiter)
    return Response(body, media_type="application/json")
