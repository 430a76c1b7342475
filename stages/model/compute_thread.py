"""One long-lived thread per model runner for all of its torch work.

CPU torch parallelises each op over a thread pool (OpenMP) that belongs to the thread
calling the op. When one live thread loaded the model (or ran a step) and another runs
the next steps, two pools compete for the cores: on 2 cores a decode step of a 30M
model took 36 ms from a second thread against 23 ms from the thread that loaded it
(``benchmarks/workers.py`` showed a worker process 1.7 times slower than the engine's own
process for that reason). So a runner loads and runs its forward passes and samples on
one dedicated thread. The event loop awaits a call without a second thread: the compute
thread wakes the loop itself when the call ends (one hop there, one back), where
awaiting the future from anyio's thread pool cost a pool thread's wake-up and hand-back
on every forward pass and sample.

A hand-over still costs two thread wake-ups. On this project's 2-vCPU test machine a
hand-over and back with an empty call took 256 µs (a ``threading.Event`` ping-pong 169
µs, an asyncio loop woken out of ``epoll`` 237 µs): more than the whole forward pass of
a small model's decode step. So a thread built with ``inline_below_s`` runs short calls
where they are awaited: :meth:`ComputeThread.run` takes a cost key (the runner's: the
step's shape), and a call whose key's recent calls took less than ``inline_below_s``
runs on the calling thread, blocking the event loop about that long at most; a call
without a key, under a key not seen yet, or under a key whose estimate rose past the
bound goes to the thread. A key's estimate is an exponential average of its calls' own
durations, timed where they ran (the hand-over is not part of them).

:class:`InlineCompute` is the other choice (``EngineConfig.inline_forward``): no thread at
all, every call runs on the calling thread, i.e. every forward pass, however long, on
the event loop's thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from time import perf_counter
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = [
    "Compute",
    "ComputeThread",
    "InlineCompute",
    "make_compute",
    "threadsafe_call_soon",
    "wake_loop",
]

T = TypeVar("T")

SMOOTHING = 0.25
"""Weight of a call's duration in its cost key's estimate."""

MAX_COST_KEYS = 256
"""Estimates a thread keeps (the least recently used dropped first)."""


def wake_loop(
    call_soon: Callable[[Callable[[], object]], object], wake: Callable[[], None]
) -> None:
    """Run ``wake`` on the event loop; a loop that has closed meanwhile is not woken."""
    with contextlib.suppress(RuntimeError):  # asyncio: loop closed; trio: RunFinishedError
        call_soon(wake)


def threadsafe_call_soon() -> Callable[[Callable[[], object]], object]:
    """The running event loop's thread-safe "call this soon" (asyncio or trio)."""
    native: Any = anyio.lowlevel.current_token().native_token
    call_soon = getattr(native, "call_soon_threadsafe", None)  # an asyncio loop
    return call_soon if call_soon is not None else native.run_sync_soon  # a TrioToken


class _Timed(Generic[T]):
    """``fn`` that records how long its call took, even when it raised."""

    def __init__(self, fn: Callable[..., T]) -> None:
        self._fn = fn
        self.duration_s: float | None = None

    def __call__(self, *args: object) -> T:
        start = perf_counter()
        try:
            return self._fn(*args)
        finally:
            self.duration_s = perf_counter() - start


class ComputeThread:
    """A single worker thread; calls run on it one at a time, in submission order (a
    call that :meth:`run` makes inline, too: never while a handed-over call is pending).

    Each call runs in a copy of the caller's context (contextvars), as
    ``anyio.to_thread.run_sync`` does, so the step's bound ``step_id`` and ``rank``
    reach logs and connector calls made on the thread.

    Args:
        name: The thread's name (``kvstep-compute-r0``).
        inline_below_s: Longest estimated duration (seconds) of a call that :meth:`run`
            makes on the awaiting thread instead (module docstring); ``0``: none.

    Attributes ``inline_calls`` and ``thread_calls`` count where :meth:`run` ran calls.
    """

    def __init__(self, name: str, *, inline_below_s: float = 0.0) -> None:
        self.name = name
        self.inline_below_s = inline_below_s
        self.inline_calls = 0
        self.thread_calls = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._thread_ident: int | None = None
        self._closed = False
        self._estimates: OrderedDict[Hashable, float] = OrderedDict()
        self._handed_over = 0  # run() calls submitted to the thread and not yet back

    def _on_thread(self) -> bool:
        return self._thread_ident == threading.get_ident()

    def _mark(self) -> None:
        self._thread_ident = threading.get_ident()

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the thread and block until it returns (or raises).

        Called from the thread itself, runs inline.
        """
        if self._on_thread():
            return fn(*args)
        self._pool.submit(self._mark).result()
        return self._pool.submit(contextvars.copy_context().run, fn, *args).result()

    def estimate_s(self, cost_key: Hashable) -> float | None:
        """How long a call under ``cost_key`` is expected to take; ``None``: not known."""
        return self._estimates.get(cost_key)

    async def run(self, fn: Callable[..., T], *args: object, cost_key: Hashable = None) -> T:
        """Await ``fn(*args)`` on the thread without blocking the event loop, or on the
        calling thread when ``cost_key``'s estimate is under ``inline_below_s``.

        Not cancellable once started (like ``anyio.to_thread.run_sync``): a
        cancellation waits for the call to finish, then propagates. The compute thread
        wakes the loop when the call ends (no thread in between). A call that raised
        counts towards its key's estimate too.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        if cost_key is None or self.inline_below_s <= 0:
            self.thread_calls += 1
            return await self._hand_over(fn, *args)
        estimate = self._estimates.get(cost_key)
        timed = _Timed(fn)
        try:
            short = estimate is not None and estimate < self.inline_below_s
            if short and not self._handed_over:
                self.inline_calls += 1
                return contextvars.copy_context().run(timed, *args)
            self.thread_calls += 1
            return await self._hand_over(timed, *args)
        finally:
            if timed.duration_s is not None:
                self._learn(cost_key, estimate, timed.duration_s)

    def _learn(self, key: Hashable, estimate: float | None, duration_s: float) -> None:
        if estimate is not None:
            duration_s = estimate + SMOOTHING * (duration_s - estimate)
        self._estimates[key] = duration_s
        self._estimates.move_to_end(key)
        while len(self._estimates) > MAX_COST_KEYS:
            self._estimates.popitem(last=False)

    async def _hand_over(self, fn: Callable[..., T], *args: object) -> T:
        done = anyio.Event()
        call_soon = threadsafe_call_soon()
        future = self._pool.submit(contextvars.copy_context().run, fn, *args)
        future.add_done_callback(lambda _: wake_loop(call_soon, done.set))
        self._handed_over += 1
        try:
            with anyio.CancelScope(shield=True):
                await done.wait()
        finally:
            self._handed_over -= 1
        return future.result()

    def close(self) -> None:
        """Stop the thread once its queued calls are done; idempotent.

        Waits for it unless called from the thread itself, so that no thread that ran
        torch outlives its runner into interpreter shutdown.
        """
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=not self._on_thread())


class InlineCompute:
    """The :class:`ComputeThread` interface without a thread: calls run where they are made.

    ``run`` blocks the event loop for the whole call (a forward pass): for an engine
    whose loop serves nothing else (offline generation, a benchmark, a worker of its
    own) or whose steps are shorter than a thread hand-over. Awaiting it checks for
    cancellation first, then the call is not cancellable, like the thread's.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` here and return its result."""
        return fn(*args)

    async def run(self, fn: Callable[..., T], *args: object, cost_key: Hashable = None) -> T:
        """Run ``fn(*args)`` on the event loop's thread (blocking the loop meanwhile), in a
        copy of the caller's context, as the thread runs it; ``cost_key`` is not used."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        return contextvars.copy_context().run(fn, *args)

    def close(self) -> None:
        """Nothing to stop."""


Compute = ComputeThread | InlineCompute
"""Where a runner's torch work runs: its own thread, or the caller's."""


def make_compute(name: str, *, inline: bool = False, inline_below_s: float = 0.0) -> Compute:
    """An :class:`InlineCompute` named ``name`` when ``inline``, else a
    :class:`ComputeThread` that runs calls estimated under ``inline_below_s`` inline."""
    if inline:
        return InlineCompute(name)
    return ComputeThread(name, inline_below_s=inline_below_s)
