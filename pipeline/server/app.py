"""The Starlette app: OpenAI completions, models, health and metrics over an AsyncEngine."""

from __future__ import annotations

import contextlib
import gc
import hmac
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.config import EngineConfig
from pipeline.engine.async_engine import AsyncEngine
from pipeline.errors import EngineDeadError, InvalidConfigError
from pipeline.logger import get_logger
from pipeline.server.chat import chat_completions
from pipeline.server.completions import completions
from pipeline.server.drain import Drain
from pipeline.server.errors import error_body, exception_handlers
from pipeline.server.kv_transfer import RELEASE_PATH, release_transfer
from pipeline.server.lora import (
    LOAD_PATH,
    UNLOAD_PATH,
    ServedLoRAs,
    load_lora_adapter,
    unload_lora_adapter,
)
from pipeline.server.metrics import LoopLagMonitor, ServerMetrics
from pipeline.server.middleware import GuardMiddleware
from pipeline.server.options import ServerOptions
from pipeline.server.prompt_encoder import PromptEncoder
from pipeline.server.reasoning import get_reasoning_parser
from pipeline.server.tokenize import detokenize, tokenize
from pipeline.server.tool_parsers import get_tool_parser
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir

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
        options: The server's limits (body cap, timeouts, API key, request shares).
        max_num_seqs: The engine's ``max_num_seqs`` (a request's choices are capped at
            ``options.max_choices(max_num_seqs)``).
        encoder: Encodes text prompts (off the loop, refusing what cannot fit).
        parse_limiter: Worker threads for parsing large bodies, apart from the
            engine's own threads so a flood of bodies cannot starve its steps.
        tool_parser: The tool-call parser of ``options.tool_call_parser``, or ``None``.
        reasoning_parser: The reasoning parser of ``options.reasoning_parser``, or
            ``None``.
        loras: The LoRA adapters served, each as a model of its name.
        drain: The shutdown drain (``options.shutdown_timeout_s``): waits for the HTTP
            requests and for the engine to go idle (no KV held for a consumer), then
            aborts the engine's requests.
    """

    def __init__(
        self,
        model_name: str,
        given: AsyncEngine | None = None,
        *,
        tokenizer: Any = None,
        max_model_len: int,
        options: ServerOptions | None = None,
        max_num_seqs: int = 64,
    ) -> None:
        self.engine: AsyncEngine | None = None
        self.model_name = model_name
        self.metrics = ServerMetrics()
        self.lag = LoopLagMonitor()
        self.tokenizer: Any = tokenizer
        self.options = options or ServerOptions()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.encoder = PromptEncoder(tokenizer, max_model_len)
        self.parse_limiter = anyio.CapacityLimiter(2)
        name = self.options.tool_call_parser
        self.tool_parser = None if name is None else get_tool_parser(name)()
        name = self.options.reasoning_parser
        self.reasoning_parser = None if name is None else get_reasoning_parser(name)()
        self.loras = ServedLoRAs(model_name)
        self._given = given
        self.drain = Drain(
            self.options.shutdown_timeout_s,
            is_idle=self._engine_idle,
            abort=self._abort_all,
            open_paths=("/health", "/metrics", RELEASE_PATH),
            registry=self.metrics.registry,
        )

    def _engine_idle(self) -> bool:
        return self.engine is None or self.engine.is_dead or self.engine.is_idle

    def _abort_all(self) -> int:
        return 0 if self.engine is None else self.engine.abort_all()

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

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot serve (``"engine is dead"``, ...), or ``None``.

        Generic on purpose: ``/health`` is unauthenticated, and the cause (a worker's
        PID, an exception) is in the log.
        """
        try:
            engine = self.running_engine()
        except EngineDeadError:
            return "engine is not running"
        if engine.is_dead:
            return "engine is dead"
        if not engine.is_running:
            return "engine is not running"
        return None

    def attach(self, engine: AsyncEngine) -> None:
        """Serve ``engine`` (already running) and feed its step reports to the metrics."""
        listeners = engine.core.step_log.listeners
        self.metrics.connector = engine.config.connector
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
    options: ServerOptions | None = None,
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
        options: Body cap, body timeout and API key (:class:`ServerOptions`); the
            connection-level options (header and keep-alive timeouts, concurrency)
            apply where uvicorn runs the app (:func:`pipeline.server.serve`).

    Returns:
        A Starlette app with ``POST /v1/completions``, ``POST /v1/chat/completions``,
        ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``,
        ``GET /health``, ``GET /metrics``, and the LoRA routes
        ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
        (:mod:`pipeline.server.lora`; ``options.lora_modules`` are served from the
        start, the engine then runs with ``enable_lora``). The app's state lives in
        ``app.state.kvstep`` (a :class:`ServerState`). Errors are OpenAI-shaped JSON
        (``pipeline.server.errors``).
    """
    options = options or ServerOptions()
    if options.lora_modules and isinstance(engine, EngineConfig) and not engine.enable_lora:
        engine = attrs.evolve(engine, enable_lora=True)
    config = engine if isinstance(engine, EngineConfig) else engine.config
    if options.lora_modules and not config.enable_lora:
        raise InvalidConfigError(
            "lora_modules", [n for n, _ in options.lora_modules], "needs an engine with enable_lora"
        )
    given = engine if isinstance(engine, AsyncEngine) else None
    state = ServerState(
        model_name or config.model,
        given,
        tokenizer=load_tokenizer(tokenizer_dir(config.model)),
        max_model_len=config.max_model_len,
        options=options,
        max_num_seqs=config.max_num_seqs,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(engine, EngineConfig):
                running = await stack.enter_async_context(AsyncEngine(engine))
            else:
                running = engine
            for name, path in options.lora_modules:  # a bad adapter fails the start
                if name not in state.loras:
                    await state.loras.add(running, name, path)
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
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route(RELEASE_PATH, release_transfer, methods=["POST"]),
            Route(LOAD_PATH, load_lora_adapter, methods=["POST"]),
            Route(UNLOAD_PATH, unload_lora_adapter, methods=["POST"]),
            Route("/health", _health, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
        ],
        middleware=[
            Middleware(GuardMiddleware, api_key=options.api_key_bytes(), drain=state.drain)
        ],
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )
    app.state.kvstep = state
    return app


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvstep
    return state


async def _models(request: Request) -> Response:
    state = _state(request)
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "kvstep"}
    return JSONResponse({"object": "list", "data": [model, *state.loras.models()]})


async def _health(request: Request) -> Response:
    """200 with counters and the leak report while the engine serves; 503 otherwise:
    ``{"status": "draining", ...}`` while the server drains for shutdown (with the
    requests in flight and the seconds left), ``"unavailable"`` when the engine is not
    running.

    ``compiled`` says whether the forward passes run compiled (``torch_compile``, the
    default of ``kvstep serve``; ``false`` where it fell back to eager, as its
    ``torch_compile_fallback`` warning says). With a connector, ``kv_connector``
    says whether its loads work: ``"degraded"`` (and ``status`` with it, still 200:
    the engine serves, recomputing) when every load of the last
    :data:`~pipeline.server.metrics.DEGRADED_AFTER_S` seconds failed. The KV events
    endpoints are shown only to callers holding the API key when one is set.
    """
    state = _state(request)
    if state.drain.draining:
        engine = state.engine
        body = {
            "status": "draining",
            "in_flight": state.drain.in_flight,
            "requests": 0 if engine is None else engine.num_requests,
            "seconds_left": round(state.drain.seconds_left(), 3),
        }
        message = "the server is shutting down (draining)"
        body |= error_body(message, "service_unavailable_error", "server_draining")
        return JSONResponse(body, status_code=503, headers={"Connection": "close"})
    reason = state.unavailable_reason()
    if reason is not None:
        body = {"status": "unavailable", "reason": reason}
        body |= error_body(reason, "service_unavailable_error", "engine_unavailable")
        return JSONResponse(body, status_code=503)
    engine = state.running_engine()
    ok: dict[str, Any] = {
        "status": "ok",
        "requests": engine.num_requests,
        "steps": engine.num_steps,
        "leaks": engine.leak_report(),
        "loop_lag": state.lag.snapshot(),
        "compiled": engine.core.compiled,  # torch_compile (false: eager, or it fell back)
    }
    if engine.config.connector is not None:
        kv = {"name": engine.config.connector, **state.metrics.kv_health.snapshot()}
        ok["kv_connector"] = kv
        if kv["state"] == "degraded":
            ok["status"] = "degraded"
    events = engine.core.kv_events
    if events is not None and _holds_api_key(request, state.options):
        # where a router subscribes (a bound wildcard host reads 0.0.0.0)
        ok["kv_events"] = events.publisher.describe()
    return JSONResponse(ok)


def _holds_api_key(request: Request, options: ServerOptions) -> bool:
    """Whether the caller sent the server's API key (``Authorization: Bearer``), or no
    key is set. ``/health`` is open, so what it shows beyond liveness is gated here."""
    key = options.api_key_bytes()
    if key is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("latin-1"), key)


async def _metrics(request: Request) -> Response:
    state = _state(request)
    engine = state.running_engine()
    text = state.metrics.render(
        queue_depth=engine.num_requests, lag=state.lag, compiled=engine.core.compiled
    )
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
