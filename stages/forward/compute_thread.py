"""One long-lived thread per model runner for all of its torch work.

CPU torch parallelises each op over a thread pool (OpenMP) that belongs to the thread
calling the op. When one live thread loaded the model (or ran a step) and another runs
the next steps, two pools compete for the cores: on 2 cores a decode step of a 30M
model took 36 ms from a second thread against 23 ms from the thread that loaded it
(``benchmarks/workers.py`` showed a worker process 1.7 times slower than the engine's own
process for that reason). So a runner loads and runs every forward pass and sample on
one dedicated thread; the event loop awaits it from anyio's thread pool, whose threads
only wait.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread

__all__ = ["ComputeThread"]

T = TypeVar("T")


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
        cancellation waits for the call to finish, then propagates.
        """
        future = self._pool.submit(contextvars.copy_context().run, fn, *args)
        return await anyio.to_thread.run_sync(future.result)

    def close(self) -> None:
        """Stop the thread once its queued calls are done; idempotent.

        Waits for it unless called from the thread itself, so that no thread that ran
        torch outlives its runner into interpreter shutdown.
        """
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=not self._on_thread())
