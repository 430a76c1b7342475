"""The health poller: every backend's ``/health``, every ``health_interval_s`` seconds."""

from __future__ import annotations

import anyio
import httpx

from pipeline.logger import get_logger
from pipeline.proxy.pool import Backend, BackendPool

__all__ = ["poll_forever", "poll_once"]

_log = get_logger()


async def _check(
    client: httpx.AsyncClient, pool: BackendPool, backend: Backend, timeout: float
) -> None:
    try:  # the status is all it needs: the body is never read (a backend's size)
        async with client.stream("GET", f"{backend.url}/health", timeout=timeout) as response:
            healthy = response.status_code < 500
            reason = f"status {response.status_code}"
    except httpx.HTTPError as exc:
        healthy, reason = False, type(exc).__name__
    if healthy != backend.healthy:
        backend.healthy = healthy
        event = "backend_healthy" if healthy else "backend_unhealthy"
        _log.warning(event, pool=pool.name, backend=backend.url, reason=reason)


async def poll_once(
    client: httpx.AsyncClient, pools: tuple[BackendPool, ...], timeout_s: float
) -> None:
    """Poll every backend of ``pools`` at once and update its ``healthy`` flag: a
    connection error, a timeout or a 5xx takes it out of rotation, anything else puts
    it back. Cancellation-safe (a cancelled poll leaves the flags as they were)."""
    async with anyio.create_task_group() as group:
        for pool in pools:
            for backend in pool.backends:
                group.start_soon(_check, client, pool, backend, timeout_s)


async def poll_forever(
    client: httpx.AsyncClient, pools: tuple[BackendPool, ...], interval_s: float, timeout_s: float
) -> None:
    """:func:`poll_once` now and every ``interval_s`` seconds, until cancelled."""
    while True:
        await poll_once(client, pools, timeout_s)
        await anyio.sleep(interval_s)
