"""``DrainingServer``: uvicorn's server, draining before it stops (``--shutdown-timeout``).

uvicorn's own graceful shutdown closes the listener the moment SIGTERM or SIGINT lands
(new clients get a refused connection) and then waits, without a bound by default, for
the requests in flight. :class:`DrainingServer` takes the signals first:

1. The first signal starts the app's :class:`~pipeline.server.drain.Drain` on the
   serving loop; the listener stays open meanwhile (new requests get 503 with
   ``Retry-After``, ``/health`` says draining). When the drain ends (idle, or the
   timeout and the abort passed) uvicorn's shutdown runs: it closes the listener and
   the idle connections, waits at most :data:`SHUTDOWN_GRACE_S` for what is left, and
   runs the app's lifespan shutdown, which closes the engine (releasing any KV still
   held for a consumer, flushing and closing the step log). The process then exits
   with status 0: the signal is not re-raised.
2. A second signal ends the drain's wait at once: what is in flight is aborted now,
   and the shutdown proceeds as above.
3. A third is uvicorn's force quit: the lifespan shutdown is skipped and the signal is
   re-raised (the process ends by it).
"""

from __future__ import annotations

import asyncio
from types import FrameType
from typing import Any

import uvicorn

from pipeline.logger import get_logger
from pipeline.server.drain import ABORT_GRACE_S, Drain

__all__ = ["SHUTDOWN_GRACE_S", "DrainingServer"]

_log = get_logger()

SHUTDOWN_GRACE_S = ABORT_GRACE_S + 1.0
"""uvicorn's ``timeout_graceful_shutdown`` after a drain: the drain has already let the
requests finish or cut them, so this only bounds a connection that will not close."""


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` that runs ``drain`` on the first SIGTERM/SIGINT (see the
    module doc); without a drain it is uvicorn's server.

    Args:
        config: uvicorn's config.
        drain: The app's drain, or ``None``.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain | None = None) -> None:
        super().__init__(config)
        self.drain = drain
        self._signals = 0
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Count the signal and act on it (runs in the signal handler: sets flags only)."""
        if self.drain is None:
            super().handle_exit(sig, frame)
            return
        self._signals += 1
        if self._signals == 2:
            self.drain.hurry()
        elif self._signals > 2:
            self._captured_signals.append(sig)
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), starting the drain once a signal came."""
        if self._signals and self._drain_task is None and self.drain is not None:
            self._drain_task = asyncio.create_task(self._run_drain(self.drain))
        return await super().on_tick(counter)

    async def _run_drain(self, drain: Drain) -> None:
        try:
            await drain.run()
        except Exception as exc:  # a broken drain must not keep the server up
            _log.error("drain_failed", error=repr(exc))
        finally:
            self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown; a drain still running (a signal-less exit) is abandoned."""
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
        await super().shutdown(sockets=sockets)
