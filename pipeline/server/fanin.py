"""Many engine requests behind one HTTP response: admit all or none, collect or stream.

A completions batch (one request per prompt) and ``n`` choices (``n`` requests per
prompt) are engine requests answered together. Request ``i`` is choice ``i``:
prompt-major, ``prompt_index * n + copy``, as vLLM numbers them. The ``n`` copies of a
prompt are admitted one after the other, so they share the prompt's KV blocks through
the prefix cache; with a ``seed``, copy ``i`` samples with ``seed + i`` (vLLM's parallel
sampling) so that the copies differ.

As in vLLM, the requests succeed or fail together: one refused at admission (a bad
token id, a full queue) refuses the whole HTTP request, and one that fails in the engine
ends the whole response with an error, aborting the others. A request fails in the
engine when its step failed or its KV could not be loaded under
``load_failure_policy="fail"`` (its last output has ``finish_reason="error"``), or when
the engine died. Non-streaming, that is a 5xx, never a 200 with ``"error"`` as a finish
reason, so that a client or a proxy retries it: 500 ``request_failed`` (the engine
still serves) or 503 ``engine_unavailable``. Streaming, the 200 and the first chunks
are already sent: the stream ends with an error event of the same shape and no
``[DONE]``. Either way the message is generic and carries the request id; the cause is
in the log. A client that goes away aborts them
all: a stream when its response task is cancelled, a non-streaming request when the ASGI
receive channel reports ``http.disconnect`` while its outputs are being collected.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.config import SamplingParams
from pipeline.engine.async_engine import AsyncEngine, RequestStream
from pipeline.errors import EngineDeadError, InvalidRequestError
from pipeline.logger import get_logger
from pipeline.lora import LoRARequest
from pipeline.request import RequestOutput
from pipeline.server.body import CLIENT_CLOSED
from pipeline.server.errors import HTTPProblem, error_body, request_id

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["FanInStream", "admit", "collect_unless_gone", "copy_params", "sse"]

_log = get_logger()
_Item = tuple[int, RequestOutput | Exception]
_INT64 = 2**63
#: Turns the requests' outputs (choice index, output), as they come, into SSE events.
Render = Callable[[AsyncIterator[tuple[int, RequestOutput]]], AsyncIterator[str]]


def copy_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of a prompt's ``n`` copies: copy ``i`` seeded ``seed + i``
    (wrapped to 64 bits); unseeded copies share ``params``."""
    if params.seed is None or n == 1:
        return [params] * n
    seeds = [(params.seed + i + _INT64) % (2 * _INT64) - _INT64 for i in range(n)]
    return [attrs.evolve(params, seed=seed) for seed in seeds]


async def admit(
    engine: AsyncEngine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    arrival_time: float | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    lora_request: LoRARequest | None = None,
    priority: int = 0,
    tenant: str | None = None,
) -> list[RequestStream]:
    """One engine request per (prompt, params), in order; all or none are admitted.
    ``arrival_time``: when the HTTP request arrived (``time.monotonic()``);
    ``kv_transfer_params``: the one request's connector data (never shared by several);
    ``lora_request``: the adapter the requested model names (``None``: the base model);
    ``priority`` and ``tenant``: every request's (the body's ``priority``, the
    ``X-Tenant-Id`` header)."""
    if kv_transfer_params is not None and len(prompts) != 1:
        raise InvalidRequestError(
            "kv_transfer_params", f"<{len(prompts)} requests>", "belongs to one engine request"
        )
    specs = {id(p.structured_outputs): p.structured_outputs for p in params}
    for spec in specs.values():  # a spec that does not compile is a 400, not a failure
        if spec is not None:
            await engine.compile_grammar(spec)
    streams: list[RequestStream] = []
    try:
        for prompt, one in zip(prompts, params, strict=True):
            stream = engine.generate(
                prompt,
                one,
                arrival_time=arrival_time,
                kv_transfer_params=kv_transfer_params,
                lora_request=lora_request,
                priority=priority,
                tenant=tenant,
            )
            streams.append(stream)
    except BaseException:
        for admitted in streams:  # all or none: abort the requests already admitted
            await admitted.aclose()
        raise
    return streams


def failed_in_engine(out: RequestOutput, http_id: str) -> HTTPProblem:
    """The 500 of a request that ended with ``finish_reason="error"`` (logged with its
    cause, which the response does not carry)."""
    _log.warning(
        "request_failed_in_engine", request_id=http_id, engine_request=out.request_id,
        error=out.error,
    )  # fmt: skip
    message = f"the request failed in the engine; retry it (request id {http_id})"
    return HTTPProblem(500, message, kind="server_error", code="request_failed")


def count_finished(state: ServerState, out: RequestOutput) -> None:
    """Count a finished request in the server's metrics."""
    state.metrics.observe_finished(out)


async def collect_unless_gone(
    request: Request, state: ServerState, streams: list[RequestStream]
) -> list[RequestOutput] | Response:
    """Each request's last output, in order; if the client disconnects meanwhile, the
    requests are aborted and a ``CLIENT_CLOSED`` response is returned instead."""
    result: list[list[RequestOutput]] = []

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    failed: list[Exception] = []
    settled: set[int] = set()  # requests that finished or failed
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            try:
                result.append(await _collect(state, streams, settled, request_id(request)))
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


async def _collect(
    state: ServerState, streams: list[RequestStream], settled: set[int], http_id: str
) -> list[RequestOutput]:
    lasts: list[RequestOutput | None] = [None] * len(streams)
    failed: list[Exception] = []

    async def collect_one(index: int, stream: RequestStream, scope: anyio.CancelScope) -> None:
        previous: float | None = None  # the request's last token time, for ITL
        try:
            async for out in stream:
                previous = state.metrics.observe_tokens(out, previous)
                lasts[index] = out
                if out.finished:
                    settled.add(index)
                if out.finished and out.finish_reason == "error":
                    count_finished(state, out)
                    raise failed_in_engine(out, http_id)
        except Exception as exc:  # one request failed: the whole response fails
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
        count_finished(state, last)
        finals.append(last)
    return finals


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


class FanInStream(StreamingResponse):
    """Server-sent events of several requests, their outputs interleaved as they come.

    One task per request forwards its outputs to a channel; ``render`` turns them into
    events (it sees every output with new tokens, and each last output but a failed
    one). A dead engine ends the events with an ``engine_unavailable`` error event, a
    request that failed in the engine with a ``request_failed`` one (no ``[DONE]``). When the
    response ends for any reason (done, client gone, a request failed), the requests
    not finished are aborted and counted as such.
    """

    def __init__(self, state: ServerState, streams: Sequence[RequestStream], render: Render):
        self._state = state
        self._streams = list(streams)
        self._render = render
        self._pending = len(self._streams)
        self._settled: set[int] = set()  # requests that finished or failed
        self._failed = self._streams[0].request_id  # the request whose failure ended it
        super().__init__(
            self._events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._http_id = str(scope.get("state", {}).get("kvstep_request_id", "-"))
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
            if aborted:  # the client went away, or another request failed
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

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        previous: dict[int, float | None] = {}  # each request's last token time, for ITL
        async for index, item in self._receive:
            if isinstance(item, Exception):
                self._failed = self._streams[index].request_id
                raise item
            if not item.new_token_ids and not item.finished:
                continue
            previous[index] = self._state.metrics.observe_tokens(item, previous.get(index))
            if item.finished:
                count_finished(self._state, item)
            if item.finished and item.finish_reason == "error":
                raise failed_in_engine(item, self._http_id)
            yield index, item

    async def _events(self) -> AsyncIterator[str]:
        try:
            async for event in self._render(self._outputs()):
                yield event
        except EngineDeadError as exc:
            _log.error(
                "stream_failed_engine_unavailable", engine_request=self._failed, error=str(exc)
            )
            message = f"the engine is unavailable (request {self._failed})"
            yield sse(error_body(message, "service_unavailable_error", "engine_unavailable"))
        except HTTPProblem as exc:  # a request failed in the engine: the 200 is sent
            yield sse(error_body(str(exc), exc.kind, exc.code, exc.param))
