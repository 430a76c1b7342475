"""``POST /v1/completions``: read, validate, admit, then stream or collect.

A request whose client goes away is aborted in both modes: a stream when its response
task is cancelled, a non-streaming request when the ASGI receive channel reports
``http.disconnect`` while its tokens are being collected.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pipeline.engine.async_engine import RequestStream
from pipeline.errors import EngineDeadError
from pipeline.logs import get_logger
from pipeline.request import RequestOutput
from pipeline.server.body import ClientGone, read_json
from pipeline.server.detokenize import Detokenizer, decode_ids_text
from pipeline.server.errors import error_body, request_id
from pipeline.server.schemas import completion_body, parse_completion_request, usage

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["completions"]

_log = get_logger()
_CLIENT_CLOSED = 499  # nginx's "client closed request": never seen by the client


async def completions(request: Request) -> Response:
    """The completions route (see the module doc)."""
    state: ServerState = request.app.state.kvstep
    try:
        body = await read_json(request, state.options, state.parse_limiter)
    except ClientGone:
        _log.info("client_disconnected_mid_body", request_id=request_id(request))
        return Response(status_code=_CLIENT_CLOSED)
    parsed = parse_completion_request(body, max_prompt_tokens=state.max_model_len)
    if parsed.model is not None and parsed.model != state.model_name:
        message = (
            f"model {parsed.model[:80]!r} is not served; the served model is {state.model_name!r}"
        )
        return JSONResponse(
            error_body(message, "not_found_error", "model_not_found", "model"), status_code=404
        )
    if isinstance(parsed.prompt, str):
        prompt = await state.encoder.encode(parsed.prompt)
    else:
        prompt = parsed.prompt
    stream = state.running_engine().generate(prompt, parsed.params)
    if parsed.stream:
        return StreamingResponse(
            _sse(state, stream, include_usage=parsed.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _collect_unless_gone(request, state, stream)


async def _collect_unless_gone(
    request: Request, state: ServerState, stream: RequestStream
) -> Response:
    """Collect the request's outputs; abort it if the client disconnects meanwhile."""
    result: list[Response] = []

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    failed: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, tg.cancel_scope)
        try:
            result.append(await _collect(state, stream))
        except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
            failed.append(exc)
        tg.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if not result:  # cancelled by the watcher: the stream aborted the request
        _log.info(
            "client_disconnected", request_id=request_id(request), engine_request=stream.request_id
        )
        state.metrics.requests.labels("abort").inc()
        return Response(status_code=_CLIENT_CLOSED)
    return result[0]


async def _collect(state: ServerState, stream: RequestStream) -> Response:
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
    finally:
        await stream.aclose()
    if last is None:  # the engine closed the stream without an output
        raise EngineDeadError("the engine ended the request without output")
    _count_finished(state, last)
    if state.tokenizer is None:
        text = decode_ids_text(last.token_ids)
    else:
        text = state.tokenizer.decode(list(last.token_ids), skip_special_tokens=True)
    body = completion_body(
        stream.request_id, state.model_name, text, last.token_ids,
        last.finish_reason, usage(last),
    )  # fmt: skip
    return JSONResponse(body)


async def _sse(
    state: ServerState, stream: RequestStream, *, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events; cancelled (client gone) it aborts the request."""
    detok = Detokenizer(state.tokenizer)
    created = int(time.time())
    finished = False
    try:
        async for out in stream:
            if not out.new_token_ids and not out.finished:
                continue
            if out.finished:
                finished = True
                _count_finished(state, out)
            body = completion_body(
                stream.request_id, state.model_name, detok.delta(out), out.new_token_ids,
                out.finish_reason if out.finished else None,
                usage(out) if out.finished and include_usage else None, created,
            )  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except EngineDeadError as exc:
        _log.error(
            "stream_failed_engine_unavailable", engine_request=stream.request_id, error=str(exc)
        )
        message = f"the engine is unavailable (request {stream.request_id})"
        body = error_body(message, "service_unavailable_error", "engine_unavailable")
        yield f"data: {json.dumps(body)}\n\n"
    finally:
        if not finished:  # the client went away (or the engine died): abort
            state.metrics.requests.labels("abort").inc()
        await stream.aclose()


def _count_finished(state: ServerState, out: RequestOutput) -> None:
    state.metrics.requests.labels(out.finish_reason or "unknown").inc()
