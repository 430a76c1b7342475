"""The Starlette app: OpenAI completions, models, health and metrics over an AsyncEngine."""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.async_engine import AsyncEngine, RequestStream
from pipeline.config import EngineConfig
from pipeline.errors import EngineDeadError, EngineOverloaded, InvalidRequestError
from pipeline.logs import get_logger
from pipeline.request import RequestOutput
from pipeline.server.metrics import LoopLagMonitor, ServerMetrics
from pipeline.server.schemas import (
    CompletionRequest,
    Detokenizer,
    completion_body,
    error_body,
    parse_completion_request,
    usage,
)
from pipeline.tokenizer import load_tokenizer

__all__ = ["ServerState", "create_app"]

_log = get_logger()


class ServerState:
    """What the routes share; ``engine`` is set while the app's lifespan is open.

    Attributes:
        engine: The running engine (``None`` outside the lifespan).
        model_name: The served model id (``/v1/models`` and each response's ``model``).
        metrics: This app's Prometheus metrics.
        lag: The event-loop lag monitor of the serving loop.
        tokenizer: A Hugging Face tokenizer, or ``None`` (token-id prompts only).
    """

    def __init__(self, model_name: str, given: AsyncEngine | None = None) -> None:
        self.engine: AsyncEngine | None = None
        self.model_name = model_name
        self.metrics = ServerMetrics()
        self.lag = LoopLagMonitor()
        self.tokenizer: Any = None
        self._given = given

    def running_engine(self) -> AsyncEngine:
        """The engine to serve with; raises ``EngineDeadError`` (503) when none runs.

        An embedder's engine is picked up on first use even when the app's own
        lifespan never ran (a mounted sub-app), metrics listener included.
        """
        if self.engine is None and self._given is not None and self._given._core is not None:
            self.attach(self._given)
        if self.engine is None:
            raise EngineDeadError("the server's engine is not running")
        return self.engine

    def attach(self, engine: AsyncEngine) -> None:
        """Serve ``engine`` (already running) and feed its step reports to the metrics."""
        listeners = engine.core.step_log.listeners
        if self.metrics.on_step not in listeners:
            listeners.append(self.metrics.on_step)
        self.engine = engine

    def detach(self) -> None:
        """Stop serving; idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None and engine._core is not None:
            with contextlib.suppress(ValueError):
                engine.core.step_log.listeners.remove(self.metrics.on_step)


def create_app(
    engine: AsyncEngine | EngineConfig,
    *,
    model_name: str | None = None,
    freeze_gc: bool = False,
) -> Starlette:
    """Build the ASGI app serving ``engine``.

    Args:
        engine: An ``EngineConfig``: the app's lifespan opens ``AsyncEngine(config)`` and
            closes it on shutdown. Or an ``AsyncEngine``: the app uses it and the
            embedder owns its lifecycle (open it before the first request, close it
            after the app stops). Mounted inside another app, this app's lifespan does
            not run by itself: enter ``app.router.lifespan_context(app)`` from the
            outer lifespan to get the event-loop lag monitor too.
        model_name: The served model id; defaults to ``config.model``.
        freeze_gc: Once the engine is up, move every object alive then out of the
            cyclic garbage collector's reach (``gc.freeze()``). The model, torch and the
            server stack are hundreds of thousands of objects; a full collection over
            them, triggered by a burst of requests, stalled the loop for 220-260 ms in a
            200-client burst (35-77 ms with the freeze). Process-wide, so it is off for
            embedders and on for ``kvstep serve``, which owns its process.

    Returns:
        A Starlette app with ``POST /v1/completions``, ``GET /v1/models``,
        ``GET /health`` and ``GET /metrics``. The app's state lives in
        ``app.state.kvstep`` (a :class:`ServerState`).
    """
    config = engine if isinstance(engine, EngineConfig) else engine.config
    given = engine if isinstance(engine, AsyncEngine) else None
    state = ServerState(model_name or config.model, given)
    state.tokenizer = load_tokenizer(config.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(engine, EngineConfig):
                running = await stack.enter_async_context(AsyncEngine(engine))
            else:
                running = engine
            state.attach(running)
            stack.callback(state.detach)
            if freeze_gc:
                gc.collect()
                gc.freeze()
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)  # runs first on exit
            tg.start_soon(state.lag.run)
            yield

    app = Starlette(
        routes=[
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
            Route("/health", _health, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
        ],
        exception_handlers={
            InvalidRequestError: _error_handler(400, "invalid_request_error"),
            EngineOverloaded: _error_handler(429, "overloaded"),
            EngineDeadError: _error_handler(503, "engine_dead"),
        },
        lifespan=lifespan,
    )
    app.state.kvstep = state
    return app


def _error_handler(code: int, kind: str) -> Any:
    async def handle(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(str(exc), kind, code), status_code=code)

    return handle


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvstep
    return state


async def _completions(request: Request) -> Response:
    state = _state(request)
    try:
        body = await request.json()
    except ValueError as exc:
        raise InvalidRequestError("body", "not JSON", f"must be a JSON object ({exc})") from exc
    parsed = parse_completion_request(body)
    if parsed.model is not None and parsed.model != state.model_name:
        message = f"model {parsed.model!r} is not served; the served model is {state.model_name!r}"
        return JSONResponse(error_body(message, "not_found_error", 404), status_code=404)
    prompt = _prompt_ids(state, parsed)
    stream = state.running_engine().generate(prompt, parsed.params)
    if parsed.stream:
        return StreamingResponse(
            _sse(state, stream),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _collect(state, stream)


def _prompt_ids(state: ServerState, parsed: CompletionRequest) -> list[int]:
    if isinstance(parsed.prompt, list):
        return parsed.prompt
    if state.tokenizer is None:
        raise InvalidRequestError(
            "prompt",
            parsed.prompt[:40],
            "text prompts need a tokenizer (tokenizer.json) in the model directory, "
            "which this model has none of; pass the prompt as a list of token ids",
        )
    ids: list[int] = state.tokenizer.encode(parsed.prompt)
    return ids


async def _collect(state: ServerState, stream: RequestStream) -> Response:
    detok = Detokenizer(state.tokenizer)
    text: list[str] = []
    last: RequestOutput | None = None
    try:
        async for out in stream:
            text.append(detok.delta(out))
            last = out
    finally:
        await stream.aclose()
    if last is None:  # the engine closed the stream without an output
        raise EngineDeadError("the engine ended the request without output")
    _count_finished(state, last)
    body = completion_body(
        stream.request_id, state.model_name, "".join(text), last.token_ids,
        last.finish_reason, usage(last),
    )  # fmt: skip
    return JSONResponse(body)


async def _sse(state: ServerState, stream: RequestStream) -> AsyncIterator[str]:
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
                usage(out) if out.finished else None, created,
            )  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except EngineDeadError as exc:
        yield f"data: {json.dumps(error_body(str(exc), 'engine_dead', 503))}\n\n"
    finally:
        if not finished:  # the client went away (or the engine died): abort
            state.metrics.requests.labels("abort").inc()
        await stream.aclose()


def _count_finished(state: ServerState, out: RequestOutput) -> None:
    state.metrics.requests.labels(out.finish_reason or "unknown").inc()


async def _models(request: Request) -> Response:
    state = _state(request)
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "kvstep"}
    return JSONResponse({"object": "list", "data": [model]})


async def _health(request: Request) -> Response:
    state = _state(request)
    engine = state.running_engine()
    return JSONResponse(
        {
            "status": "ok",
            "requests": engine.num_requests,
            "steps": engine.num_steps,
            "leaks": engine.leak_report(),
            "loop_lag": state.lag.snapshot(),
        }
    )


async def _metrics(request: Request) -> Response:
    state = _state(request)
    engine = state.running_engine()
    text = state.metrics.render(queue_depth=engine.num_requests, lag=state.lag)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
