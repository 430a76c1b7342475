"""``POST /v1/completions``: read, validate, admit, then stream or collect.

A batch (``prompt`` a list of prompts, see :mod:`pipeline.server.prompts`) is one engine
request per prompt, all admitted before the response starts; the response has one
choice per prompt (``index`` in the batch's order) and ``usage`` summed over them. As
in vLLM, the prompts succeed or fail together: a prompt refused at admission (a bad
token id, a full queue) refuses the whole HTTP request, and a request that fails in the
engine ends the whole response with an error (non-streaming: the error response;
streaming: an error event, no ``[DONE]``), aborting the other prompts' requests.

Streaming interleaves the prompts' chunks as their tokens come, each chunk carrying its
choice's ``index``. With ``stream_options.include_usage`` true, a last chunk with
``choices: []`` and the summed ``usage`` precedes ``[DONE]`` (OpenAI's shape); without
it no chunk carries ``usage``.

A request whose client goes away is aborted in both modes: a stream when its response
task is cancelled, a non-streaming request when the ASGI receive channel reports
``http.disconnect`` while its tokens are being collected.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.engine.async_engine import RequestStream
from pipeline.errors import EngineDeadError
from pipeline.logs import get_logger
from pipeline.request import RequestOutput
from pipeline.server.body import CLIENT_CLOSED, read_body
from pipeline.server.detokenize import Detokenizer, decode_ids_text
from pipeline.server.errors import error_body, request_id
from pipeline.server.prompts import fit_max_tokens
from pipeline.server.schemas import completion_body, parse_completion_request, usage

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["completions"]

_log = get_logger()
_Item = tuple[int, RequestOutput | Exception]


async def completions(request: Request) -> Response:
    """The completions route (see the module doc)."""
    state: ServerState = request.app.state.kvstep
    body = await read_body(request)
    if isinstance(body, Response):  # the client went away mid-body
        return body
    parsed = parse_completion_request(body, max_prompt_tokens=state.max_model_len)
    if parsed.model is not None and parsed.model != state.model_name:
        message = (
            f"model {parsed.model[:80]!r} is not served; the served model is {state.model_name!r}"
        )
        return JSONResponse(
            error_body(message, "not_found_error", "model_not_found", "model"), status_code=404
        )
    prompts = [await state.encoder.encode(p) if isinstance(p, str) else p for p in parsed.prompts]
    params = [
        fit_max_tokens(parsed.params, len(p), state.max_model_len, given=parsed.max_tokens_given)
        for p in prompts
    ]
    engine = state.running_engine()
    streams: list[RequestStream] = []
    try:
        for prompt, prompt_params in zip(prompts, params, strict=True):
            streams.append(engine.generate(prompt, prompt_params))
    except BaseException:
        for admitted in streams:  # all or none: abort the prompts already admitted
            await admitted.aclose()
        raise
    if parsed.stream:
        return _BatchStream(state, streams, include_usage=parsed.include_usage)
    return await _collect_unless_gone(request, state, streams)


async def _collect_unless_gone(
    request: Request, state: ServerState, streams: list[RequestStream]
) -> Response:
    """Collect the requests' outputs; abort them if the client disconnects meanwhile."""
    result: list[Response] = []

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    failed: list[Exception] = []
    settled: set[int] = set()  # prompts whose request finished or failed
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            try:
                result.append(await _collect(state, streams, settled))
            except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                failed.append(exc)
            tg.cancel_scope.cancel()
    finally:
        aborted = len(streams) - len(settled)
        for stream in streams:
            await stream.aclose()  # aborts what has not finished
    if aborted:
        state.metrics.requests.labels("abort").inc(aborted)
    if failed:
        raise failed[0]
    if not result:  # cancelled by the watcher: the streams aborted their requests
        _log.info(
            "client_disconnected",
            request_id=request_id(request),
            engine_requests=[s.request_id for s in streams],
        )
        return Response(status_code=CLIENT_CLOSED)
    return result[0]


async def _collect(state: ServerState, streams: list[RequestStream], settled: set[int]) -> Response:
    lasts: list[RequestOutput | None] = [None] * len(streams)
    failed: list[Exception] = []

    async def collect_one(index: int, stream: RequestStream, scope: anyio.CancelScope) -> None:
        try:
            async for out in stream:
                lasts[index] = out
                if out.finished:
                    settled.add(index)
        except Exception as exc:  # one prompt failed: the whole request fails
            settled.add(index)
            failed.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for index, stream in enumerate(streams):
            tg.start_soon(collect_one, index, stream, tg.cancel_scope)
    if failed:
        raise failed[0]
    finals: list[RequestOutput] = []
    for last in lasts:
        if last is None:  # the engine closed the stream without an output
            raise EngineDeadError("the engine ended the request without output")
        _count_finished(state, last)
        finals.append(last)
    choices = []
    for index, (stream, last) in enumerate(zip(streams, finals, strict=True)):
        if state.tokenizer is None:
            text = decode_ids_text(last.token_ids)
        else:
            text = state.tokenizer.decode(list(last.token_ids), skip_special_tokens=True)
        one = completion_body(
            stream.request_id, state.model_name, text, last.token_ids,
            last.finish_reason, None, index=index,
        )  # fmt: skip
        choices.extend(one["choices"])
    body = completion_body(streams[0].request_id, state.model_name, "", (), None, usage(*finals))
    body["choices"] = choices
    return JSONResponse(body)


class _BatchStream(StreamingResponse):
    """Server-sent events of a batch's requests, interleaved as their outputs come.

    One task per request forwards its outputs to a channel; the response drains it.
    When the response ends for any reason (done, client gone, a request failed), the
    requests not finished are aborted.
    """

    def __init__(
        self, state: ServerState, streams: Sequence[RequestStream], *, include_usage: bool
    ) -> None:
        self._state = state
        self._streams = list(streams)
        self._include_usage = include_usage
        self._pending = len(self._streams)
        self._settled: set[int] = set()  # prompts whose request finished or failed
        super().__init__(
            self._events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        channel, output = anyio.create_memory_object_stream[_Item](math.inf)
        self._send: MemoryObjectSendStream[_Item] = channel
        self._receive: MemoryObjectReceiveStream[_Item] = output
        try:
            async with anyio.create_task_group() as tg:
                for index, stream in enumerate(self._streams):
                    tg.start_soon(self._pump, index, stream)
                await super().__call__(scope, receive, send)
                tg.cancel_scope.cancel()
        finally:
            channel.close()
            output.close()
            aborted = len(self._streams) - len(self._settled)
            if aborted:  # the client went away, or another prompt's request failed
                self._state.metrics.requests.labels("abort").inc(aborted)
            for stream in self._streams:
                await stream.aclose()

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._send.send_nowait((index, out))
                if out.finished:
                    self._settled.add(index)
        except Exception as exc:
            self._settled.add(index)
            self._send.send_nowait((index, exc))
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._send.close()

    async def _events(self) -> AsyncIterator[str]:
        state = self._state
        detoks = [Detokenizer(state.tokenizer) for _ in self._streams]
        finals: list[RequestOutput] = []
        created = int(time.time())
        rid = self._streams[0].request_id
        async for index, item in self._receive:
            if isinstance(item, EngineDeadError):
                yield _data(_engine_unavailable(self._streams[index].request_id, item))
                return
            if isinstance(item, Exception):
                raise item
            out = item
            if not out.new_token_ids and not out.finished:
                continue
            if out.finished:
                finals.append(out)
                _count_finished(state, out)
            body = completion_body(
                rid, state.model_name, detoks[index].delta(out), out.new_token_ids,
                out.finish_reason if out.finished else None, None, created, index=index,
            )  # fmt: skip
            yield _data(body)
        if self._include_usage and len(finals) == len(self._streams):
            body = completion_body(rid, state.model_name, "", (), None, usage(*finals), created)
            body["choices"] = []
            yield _data(body)
        yield "data: [DONE]\n\n"


def _engine_unavailable(engine_request: str, exc: Exception) -> dict[str, Any]:
    _log.error("stream_failed_engine_unavailable", engine_request=engine_request, error=str(exc))
    message = f"the engine is unavailable (request {engine_request})"
    return error_body(message, "service_unavailable_error", "engine_unavailable")


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _count_finished(state: ServerState, out: RequestOutput) -> None:
    state.metrics.observe_finished(out)
