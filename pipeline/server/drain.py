"""``Drain``: a server's bounded shutdown (``--shutdown-timeout``).

On SIGTERM or SIGINT, ``kvstep serve`` and ``kvstep proxy`` drain before they stop
(:mod:`pipeline.server.draining`): the listener stays open, ``/health`` answers 503
``{"status": "draining"}`` so a load balancer moves traffic away, and every new API
request gets a 503 ``server_draining`` error with ``Retry-After`` and
``Connection: close``, while the requests already in flight run on. The drain ends when
nothing is in flight and the app is idle (a server's engine: no request, no KV held for
a consumer, no transfer), or after ``timeout_s``: then the app's ``abort`` ends what is
left (a server's streams end with ``finish_reason: "abort"``), and what still runs
``abort_grace_s`` later is cut (its connection closed mid-response; uvicorn logs
"ASGI callable returned without completing response"). The proxy has nothing to abort
and cuts at once.

Answering 503 on the open listener, rather than closing it, is deliberate: a refused
connection looks like a crash to a client and to a balancer, a 503 with ``Retry-After``
says "retry elsewhere", and ``/health`` can say why.

The middleware (:class:`~pipeline.server.middleware.GuardMiddleware`) asks
:meth:`Drain.admits` and runs each admitted request under :meth:`Drain.track`; the
uvicorn server runs :meth:`Drain.run` on the first signal and :meth:`Drain.hurry` on the
second. An embedder serving the app some other way calls ``run()`` itself. Everything
here runs on the app's event loop, but :meth:`hurry`, which only sets a flag (the waits
poll it), so a signal handler may call it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator

import anyio
import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge

from pipeline.logger import get_logger

__all__ = ["ABORT_GRACE_S", "RETRY_AFTER_S", "Drain", "DrainResult"]

_log = get_logger()

ABORT_GRACE_S = 2.0
"""How long a server's requests aborted at the deadline get to write their last event
(the ``finish_reason: "abort"`` chunk and ``[DONE]``) before they are cut (the default
of :class:`Drain`'s ``abort_grace_s``)."""

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a request refused while draining: retry at once, elsewhere
(the balancer has seen ``/health`` say draining); waiting on this server gains nothing."""

_POLL_S = 0.05


@attrs.frozen
class DrainResult:
    """How a drain ended.

    Attributes:
        waited_s: Seconds from its start to its end.
        timed_out: Whether the timeout passed (or :meth:`Drain.hurry` was called) with
            work left.
        aborted: Requests the app's ``abort`` ended at the deadline (a server's engine
            requests).
        cut: HTTP requests still running ``abort_grace_s`` after the abort, cancelled
            (their connections closed mid-response).
    """

    waited_s: float
    timed_out: bool
    aborted: int
    cut: int


class Drain:
    """Whether a server is draining, what it has in flight, and the drain itself.

    Args:
        timeout_s: How long :meth:`run` lets the requests in flight finish (``0``: abort
            them at once).
        is_idle: Whether the app has nothing left to finish besides the HTTP requests
            (a server: its engine is idle, so no KV is held for a consumer); polled.
        abort: Ends the app's work at the deadline; returns how many requests it
            aborted (a server aborts its engine's requests; their streams end with
            ``finish_reason: "abort"``).
        abort_grace_s: How long the requests get, after ``abort``, to end by
            themselves before they are cut.
        open_paths: Paths answered while draining and not counted in flight
            (``/health``, ``/metrics``, and a server's KV release, which frees KV).
        registry: Where the ``{prefix}_draining`` gauge and the
            ``{prefix}_drain_refused_total`` and ``{prefix}_drain_aborted_total``
            counters go.
        prefix: The metrics' name prefix (``kvstep_server``, ``kvstep_proxy``).
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        is_idle: Callable[[], bool] = lambda: True,
        abort: Callable[[], int] = lambda: 0,
        abort_grace_s: float = ABORT_GRACE_S,
        open_paths: Collection[str] = ("/health", "/metrics"),
        registry: CollectorRegistry | None = None,
        prefix: str = "kvstep_server",
    ) -> None:
        self.timeout_s = timeout_s
        self._is_idle = is_idle
        self._abort = abort
        self._abort_grace_s = abort_grace_s
        self._open = frozenset(open_paths)
        self._scopes: set[anyio.CancelScope] = set()
        self._started: float | None = None
        self._hurried = False
        self.result: DrainResult | None = None
        reg = registry if registry is not None else CollectorRegistry()
        self._gauge = Gauge(
            f"{prefix}_draining", "1 while draining for shutdown (new requests get 503)",
            registry=reg,
        )  # fmt: skip
        self._refused = Counter(
            f"{prefix}_drain_refused", "Requests refused (503) while draining", registry=reg
        )
        self._aborted = Counter(
            f"{prefix}_drain_aborted",
            "Requests aborted or cut at the end of the drain (--shutdown-timeout passed)",
            registry=reg,
        )

    @property
    def draining(self) -> bool:
        """Whether :meth:`run` was called (it stays true once the drain ended)."""
        return self._started is not None

    @property
    def in_flight(self) -> int:
        """HTTP requests running under :meth:`track`."""
        return len(self._scopes)

    def seconds_left(self) -> float:
        """Seconds until the deadline (``timeout_s`` while not draining; ``0`` after it)."""
        if self._started is None:
            return self.timeout_s
        if self._hurried:
            return 0.0
        return max(0.0, self._started + self.timeout_s - time.monotonic())

    def admits(self, path: str) -> bool:
        """Whether a request for ``path`` may start now: not draining, or an open path."""
        return self._started is None or path in self._open

    def tracks(self, path: str) -> bool:
        """Whether a request for ``path`` counts in flight (every path but the open ones)."""
        return path not in self._open

    def refused(self) -> None:
        """Count a request refused because of the drain."""
        self._refused.inc()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one HTTP request in flight while the block runs, inside a cancel scope
        that the drain cancels when it cuts what is left (the block then ends quietly).
        Enter and leave it in one task."""
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)

    def hurry(self) -> None:
        """End the drain's wait now (a second signal): what is in flight is aborted at
        once. Safe from a signal handler; idempotent."""
        self._hurried = True

    async def run(self) -> DrainResult:
        """Drain: refuse new requests, wait for the ones in flight (up to ``timeout_s``),
        then abort, then cut what is left. Called once: a later call returns at once,
        with the first one's result (an empty one while the first still runs).
        Cancelling it is safe: the app stays draining (new requests refused), and
        nothing is aborted or cut.

        Returns:
            How the drain ended (also kept as :attr:`result`).
        """
        if self._started is not None:
            return self.result or DrainResult(0.0, False, 0, 0)
        self._started = time.monotonic()
        self._gauge.set(1)
        _log.info("draining", in_flight=self.in_flight, timeout_s=self.timeout_s)
        await self._wait(self._done, self.seconds_left, hurried=lambda: self._hurried)
        timed_out = not self._done()
        aborted = cut = 0
        if timed_out:
            aborted = self._abort()
            grace_end = time.monotonic() + self._abort_grace_s
            await self._wait(lambda: not self._scopes, lambda: grace_end - time.monotonic())
            cut = len(self._scopes)
            for scope in list(self._scopes):
                scope.cancel()
            self._aborted.inc(max(aborted, cut))
        waited = time.monotonic() - self._started
        self.result = DrainResult(round(waited, 3), timed_out, aborted, cut)
        _log.info("drained", **attrs.asdict(self.result))
        return self.result

    def _done(self) -> bool:
        return not self._scopes and self._is_idle()

    @staticmethod
    async def _wait(
        done: Callable[[], bool],
        left: Callable[[], float],
        hurried: Callable[[], bool] = lambda: False,
    ) -> None:
        while not done() and left() > 0 and not hurried():
            await anyio.sleep(min(_POLL_S, max(left(), 0.0)))
