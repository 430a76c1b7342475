"""One long-lived thread per model runner for all of its torch work.

CPU torch parallelises each op over a thread pool (OpenMP) that belongs to the thread
calling the op. When one live thread loaded the model (or ran a step) and another runs
the next steps, two pools compete for the cores: on 2 cores a decode step of a 30M
model took 36 ms from a second thread against 23 ms from the thread that loaded it
(``benchmarks/workers.py`` showed a worker process 1.7 times slower than the engine's own
process for that reason). So a runner loads and runs every forward pass and sample on
one dedicated thread. The event loop awaits a call without a second thread: the compute
thread wakes the loop itself when the call ends (one hop there, one back), where
awaiting the future from anyio's thread pool cost a pool thread's wake-up and hand-back
on every forward pass and sample.

:class:`InlineCompute` is the other choice (``EngineConfig.inline_forward``): no thread at
all, every call runs on the calling thread, i.e. the forward pass on the event loop's
thread. A hand-over between threads costs two thread wake-ups a step, and on a small
model whose forward pass is Python-bound (the GIL serialises it with the loop's work
anyway) they were the larger part of a decode step's overhead
(``benchmarks/step_overhead.py``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["Compute", "ComputeThread", "InlineCompute", "make_compute"]

T = TypeVar("T")


def _wake(call_soon: Callable[[Callable[[], object]], object], wake: Callable[[], None]) -> None:
    """Run ``wake`` on the event loop; a loop that has closed meanwhile is not woken."""
    with contextlib.suppress(RuntimeError):  # asyncio: loop closed; trio: RunFinishedError
        call_soon(wake)


def _threadsafe_call_soon() -> Callable[[Callable[[], object]], object]:
    """The running event loop's thread-safe "call this soon" (asyncio or trio)."""
    native: Any = anyio.lowlevel.current_token().native_token
    call_soon = getattr(native, "call_soon_threadsafe", None)  # an asyncio loop
    return call_soon if call_soon is not None else native.run_sync_soon  # a TrioToken


class ComputeThread:
    """A single worker thread; calls run on it one at a time, in submission order.

    Each call runs in a copy of the caller's context (contextvars), as
    ``anyio.to_thread.run_sync`` does, so the step's bound ``step_id`` and ``rank``
    reach logs and connector calls made on the thread.

    Args:
        name: The thread's name (``kvstep-compute-r0``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._thread_ident: int | None = None
        self._closed = False

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

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Await ``fn(*args)`` on the thread without blocking the event loop.

        Not cancellable once submitted (like ``anyio.to_thread.run_sync``): a
        cancellation waits for the call to finish, then propagates. The compute thread
        wakes the loop when the call ends (no thread in between).
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        done = anyio.Event()
        call_soon = _threadsafe_call_soon()
        future = self._pool.submit(contextvars.copy_context().run, fn, *args)
        future.add_done_callback(lambda _: _wake(call_soon, done.set))
        with anyio.CancelScope(shield=True):
            await done.wait()
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

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the event loop's thread (blocking the loop meanwhile), in a
        copy of the caller's context, as the thread runs it."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        return contextvars.copy_context().run(fn, *args)

    def close(self) -> None:
        """Nothing to stop."""


Compute = ComputeThread | InlineCompute
"""Where a runner's torch work runs: its own thread, or the caller's."""


def make_compute(name: str, *, inline: bool = False) -> Compute:
    """A :class:`ComputeThread` named ``name``, or an :class:`InlineCompute` when ``inline``."""
    return InlineCompute(name) if inline else ComputeThread(name)
