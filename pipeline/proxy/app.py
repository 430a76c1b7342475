"""The proxy's Starlette app: the routes, ``/health``, ``/metrics``, the poller."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.errors import InvalidConfigError
from pipeline.proxy.event_watch import watch_forever
from pipeline.proxy.health import poll_forever
from pipeline.proxy.kv_aware import KVAwareRouter
from pipeline.proxy.kv_follow import EventSource, follow
from pipeline.proxy.metrics import BackendEvents, ProxyMetrics
from pipeline.proxy.options import ProxyOptions
from pipeline.proxy.pool import BackendPool
from pipeline.proxy.routes import chat_completions, completions
from pipeline.proxy.upstream import Hop
from pipeline.server.drain import Drain
from pipeline.server.errors import error_body, error_response, exception_handlers
from pipeline.server.middleware import GuardMiddleware
from pipeline.server.options import ServerOptions
from pipeline.tokenizer import load_tokenizer

__all__ = ["ProxyState", "create_proxy_app"]


class ProxyState:
    """What the proxy's routes share (``app.state.kvstep``).

    Attributes:
        proxy: The backends and upstream limits.
        options: The proxy's own limits (body cap and timeout, API key), as a server's.
        parse_limiter: Worker threads for parsing large bodies (``read_body``).
        pools: The ``backend`` pool (replicas), or the ``prefill`` and ``decode`` pools
            in that order.
        metrics: The proxy's Prometheus metrics.
        routers: The kv-aware policy's router of each pool (none under the others).
        timeout_s: The longest a whole upstream answer may take to read.
        prefill: The hop to the producers (``None`` in front of replicas); set while
            the lifespan is open.
        decode: The hop that answers the client: to the consumers, or to the replicas;
            set while the lifespan is open.
        drain: The shutdown drain (``options.shutdown_timeout_s``): waits for the
            requests in flight, then cuts them (the backends see the client go and
            abort their requests).
    """

    def __init__(self, proxy: ProxyOptions, options: ServerOptions) -> None:
        self.proxy = proxy
        self.options = options
        self.parse_limiter = anyio.CapacityLimiter(2)
        names = ("prefill", "decode") if proxy.disaggregated else ("backend",)
        self.pools = tuple(BackendPool(n, getattr(proxy, n), proxy.policy) for n in names)
        self.metrics = ProxyMetrics()
        self.routers = kv_aware_routers(proxy, self.pools, self.metrics)
        self.timeout_s = proxy.upstream_timeout_s
        self.prefill: Hop | None = None
        self.decode: Hop
        self.drain = Drain(
            options.shutdown_timeout_s,
            abort_grace_s=0.0,  # nothing to abort: the relayed streams are cut at once
            registry=self.metrics.registry,
            prefix="kvstep_proxy",
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the upstream client and poll the backends' health until exit."""
        proxy = self.proxy
        timeout = httpx.Timeout(proxy.upstream_timeout_s, connect=proxy.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        key = proxy.backend_api_key  # every request and poll to a backend carries it
        headers = {"authorization": f"Bearer {key}"} if key is not None else None
        async with httpx.AsyncClient(
            timeout=timeout, limits=limits, trust_env=False, headers=headers
        ) as client:
            cap = proxy.max_response_bytes
            hops = [Hop(pool, client, self.metrics, cap) for pool in self.pools]
            self.decode = hops[-1]
            self.prefill = hops[0] if len(hops) == 2 else None
            async with anyio.create_task_group() as group:
                group.start_soon(
                    poll_forever,
                    client,
                    self.pools,
                    proxy.health_interval_s,
                    proxy.health_timeout_s,
                )
                for router in self.routers:
                    for i, backend in enumerate(router.pool.backends):
                        given = EventSource(proxy.kv_events[i], None) if proxy.kv_events else None
                        wait = proxy.health_timeout_s
                        group.start_soon(
                            follow, router.index, backend, client, given, wait, router.watch
                        )
                    check_s = min(1.0, proxy.events_silent_s / 4)
                    group.start_soon(watch_forever, router.watch, check_s)
                try:
                    yield
                finally:
                    group.cancel_scope.cancel()

    async def prompt_hashes(self, path: str, body: dict[str, Any]) -> list[Any]:
        """The block hashes the kv-aware policy routes ``body`` by (``[]`` for the
        other policies)."""
        return await self.routers[0].prompt_hashes(path, body) if self.routers else []


def kv_aware_routers(
    proxy: ProxyOptions, pools: tuple[BackendPool, ...], metrics: ProxyMetrics
) -> tuple[KVAwareRouter, ...]:
    """One :class:`KVAwareRouter` per pool under the ``kv-aware`` policy (each pool's
    ``chooser``), sharing the model's tokenizer; none under the other policies.

    Raises:
        InvalidConfigError: ``proxy.tokenizer`` names no directory with a
            ``tokenizer.json``.
        ModelLoadError: The tokenizer files cannot be read.
    """
    if proxy.policy != "kv-aware":
        return ()
    tokenizer = None
    if proxy.tokenizer is not None:
        tokenizer = load_tokenizer(proxy.tokenizer)
        if tokenizer is None:
            raise InvalidConfigError(
                "tokenizer", proxy.tokenizer, "a directory with tokenizer.json"
            )
    routers = []
    for pool in pools:
        router = KVAwareRouter(
            pool,
            tokenizer=tokenizer,
            block_size=proxy.block_size,
            hash_seed=proxy.hash_seed,
            hash_format="bytes" if proxy.hash_format == "bytes" else "int",
            load_weight=proxy.load_weight,
            max_blocks=proxy.max_index_blocks,
            metrics=metrics,
            max_backend_blocks=proxy.max_backend_blocks,
            silent_after_s=proxy.events_silent_s,
        )
        pool.chooser = router.choose
        routers.append(router)
    return tuple(routers)


def create_proxy_app(proxy: ProxyOptions, options: ServerOptions | None = None) -> Starlette:
    """The proxy as an ASGI app; its lifespan opens the upstream client and the poller.

    ``options`` guards the proxy itself as it guards ``kvstep serve`` (API key, body cap
    and timeout; default :class:`ServerOptions`). The routes need the lifespan to run.
    """
    state = ProxyState(proxy, options or ServerOptions())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with state.running():
            yield

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", _health, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
        ],
        middleware=[
            Middleware(GuardMiddleware, api_key=state.options.api_key_bytes(), drain=state.drain)
        ],
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )
    app.state.kvstep = state
    return app


async def _health(request: Request) -> Response:
    """200 with the pools' health; 503 when a pool has no healthy backend, or
    ``{"status": "draining", ...}`` while the proxy drains for shutdown."""
    state: ProxyState = request.app.state.kvstep
    if state.drain.draining:
        body = {
            "status": "draining",
            "in_flight": state.drain.in_flight,
            "seconds_left": round(state.drain.seconds_left(), 3),
        }
        message = "the proxy is shutting down (draining)"
        body |= error_body(message, "service_unavailable_error", "server_draining")
        return JSONResponse(body, status_code=503, headers={"Connection": "close"})
    pools: dict[str, dict[str, int]] = {
        p.name: {"healthy": p.num_healthy, "total": len(p.backends)} for p in state.pools
    }
    for router in state.routers:  # kv-aware: how many backends send no events
        pools[router.pool.name]["kv_events_silent"] = len(router.watch.silent_backends())
    down = [p.name for p in state.pools if not p.num_healthy]
    if down:
        message = f"no healthy backend in pool {', '.join(down)}"
        return error_response(503, message, "service_unavailable_error", "no_healthy_backend")
    return JSONResponse({"status": "ok", "pools": pools})


async def _metrics(request: Request) -> Response:
    state: ProxyState = request.app.state.kvstep
    events = {
        url: BackendEvents(
            router.index.num_blocks(url),
            router.watch.silent(url),
            router.watch.last_event_age(url),
            router.index.refused[url],
        )
        for router in state.routers
        for url in (b.url for b in router.pool.backends)
    }
    text = state.metrics.render(state.pools, events)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
