"""uvicorn's h11 protocol with a deadline on request headers (against slowloris).

uvicorn times out idle keep-alive connections but not a client that sends its headers
a byte at a time: such a client holds a connection (and a slot of
``limit_concurrency``) forever. :func:`header_timeout_protocol` returns an
``H11Protocol`` subclass that arms a timer whenever the connection waits for a
request's headers (when it opens, and after each response) and disarms it once h11
has the whole request line and headers; if the timer fires, the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.logger import get_logger

if TYPE_CHECKING:
    from pipeline.server.drain import Drain
    from pipeline.server.options import ServerOptions

__all__ = ["SERVER_LOOP", "header_timeout_protocol", "run_uvicorn"]

SERVER_LOOP = "asyncio"
"""uvicorn's event loop for ``kvstep serve``: asyncio's own, not uvicorn's default
``"auto"``, which takes uvloop whenever it imports (installed beside vLLM or with
``uvicorn[standard]``). With uvloop, ``kvstep serve`` measured slower under ``vllm bench
serve`` at 6 requests/s on a 2-core AMD EPYC, bfloat16: TPOT 13.6-15.1 ms against
11.8-14.1 on asyncio's loop, TTFT 89-94 against 78-94 ms, asyncio's better in each of five
alternating pairs (README, "On the CPU")."""

_log = get_logger()


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An ``H11Protocol`` class closing connections whose headers take too long."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()  # the request's headers are in

        def on_response_complete(self) -> None:
            self._arm_header_timer()  # disarmed again if a pipelined request is waiting
            super().on_response_complete()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport is not None and not self.transport.is_closing():
                _log.info("connection_closed_header_timeout", client=str(self.client))
                self.transport.close()

    return HeaderTimeoutH11Protocol


def run_uvicorn(
    app: Any,
    host: str,
    port: int,
    options: ServerOptions,
    access_log: bool,
    server_class: type[Any],
    drain: Drain | None = None,
) -> None:
    """Serve ``app`` with ``server_class`` (a
    :class:`~pipeline.server.draining.DrainingServer`) under ``options``' guards (header
    deadline, keep-alive, concurrency limit) until it exits; a signal runs ``drain``
    first (bounded by ``options.shutdown_timeout_s``), then uvicorn's shutdown, itself
    bounded by :data:`~pipeline.server.draining.SHUTDOWN_GRACE_S`.

    Raises:
        SystemExit: 3 when the server did not start (uvicorn's STARTUP_FAILURE).
    """
    import uvicorn

    from pipeline.server.draining import SHUTDOWN_GRACE_S

    server = server_class(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=access_log,
            lifespan="on",
            http=header_timeout_protocol(options.header_timeout_s),
            loop=SERVER_LOOP,
            timeout_keep_alive=max(1, round(options.timeout_keep_alive_s)),
            limit_concurrency=options.limit_concurrency,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,  # type: ignore[arg-type]  # a float
        ),
        drain=drain,
    )
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server.run()
    if not server.started:
        raise SystemExit(3)
