"""Loads from the host pool into the paged cache, layer by layer, off the forward thread.

A :class:`LoadJob` is one batch of slot → block copies (one step's loads, or one parked
request's async load). A loader runs it layer 0 first and makes each layer's completion
visible on its own, so the forward pass computes layer 0 while later layers arrive:

* :class:`ThreadLoader` (CPU): one background thread per loader, FIFO; each layer sets a
  ``threading.Event``; ``wait_layer`` blocks on that event only.
* :class:`StreamLoader` (CUDA): queues every layer's copies on the device's load stream
  at submit and records one event per layer; ``wait_layer`` makes the *current* (compute)
  stream wait for it without blocking the host. Import-safe on CPU; untested here.

A job never raises into its waiters: a failed copy (or a checksum mismatch) marks the
blocks it covers as failed, and a layer's event is set whatever happens.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from connectors.offload.pool import CopyRun, HostKVPool, run_blocks
from pipeline.device_sync import DeviceEvent, DeviceSync
from pipeline.logger import get_logger

__all__ = ["LoadJob", "ThreadLoader", "StreamLoader"]

log = get_logger()


class LoadJob:
    """One batch of loads. Thread-safe: its state is read and written across threads.

    Args:
        runs: The copies (slot runs → block runs).
        num_layers: Layers of the paged cache.
        req_ids: The requests whose blocks it loads.
        verify: Check each layer's slots against their checksums before copying.
    """

    def __init__(
        self, runs: Sequence[CopyRun], num_layers: int, req_ids: frozenset[str], verify: bool
    ) -> None:
        self.runs = tuple(runs)
        self.req_ids = req_ids
        self.verify = verify
        self.num_blocks = sum(run.length for run in self.runs)
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
        self.device_events: list[DeviceEvent] = []
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._failed: set[int] = set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Skip the layers not started yet. Never blocks; idempotent."""
        self._cancelled.set()

    def fail(self, blocks: set[int]) -> None:
        """Mark ``blocks`` as failed to load."""
        with self._lock:
            self._failed |= blocks

    def fail_all(self) -> None:
        """Mark every block of the job as failed (a timeout, or a copy that raised)."""
        self.fail(run_blocks(self.runs))

    @property
    def failed_blocks(self) -> frozenset[int]:
        """Blocks that failed so far."""
        with self._lock:
            return frozenset(self._failed)

    def finish(self) -> None:
        """Set every layer's event and the job's (whatever happened)."""
        for event in self.layer_done:
            event.set()
        self.done.set()


def _load_layer(pool: HostKVPool, kv: torch.Tensor, job: LoadJob, layer: int) -> None:
    try:
        if job.verify:
            job.fail(pool.verify_layer(layer, job.runs))
        pool.load_layer(layer, kv, job.runs)
    except Exception as exc:
        log.error("offload: load copy failed", layer=layer, error=repr(exc))
        job.fail_all()


class ThreadLoader:
    """Runs load jobs on one background thread, in submission order (CPU caches).

    Args:
        pool: The host pool to copy from.
        kv_caches: The paged cache, one tensor per layer.
        name: The thread's name.
    """

    def __init__(self, pool: HostKVPool, kv_caches: Sequence[torch.Tensor], name: str) -> None:
        self.pool = pool
        self.kv_caches = list(kv_caches)
        self._queue: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._started = False
        self._closed = False

    def submit(self, job: LoadJob) -> None:
        """Queue ``job``; returns at once. Event loop thread."""
        if self._closed:
            job.cancel()
            job.finish()
            return
        if not self._started:
            self._started = True
            self._thread.start()
        self._queue.put(job)

    def load_layer(self, layer: int, kv: torch.Tensor, job: LoadJob) -> None:
        """Copy (and verify) one layer of ``job``. Runs on the loader thread; tests
        replace it to make a layer slow."""
        _load_layer(self.pool, kv, job, layer)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                for layer, kv in enumerate(self.kv_caches):
                    if job.cancelled:
                        break
                    try:
                        self.load_layer(layer, kv, job)
                    finally:
                        job.layer_done[layer].set()
            except BaseException as exc:  # never leave a waiter behind
                log.error("offload: loader failed", error=repr(exc))
                job.fail_all()
            finally:
                job.finish()

    @staticmethod
    def wait_layer(job: LoadJob, layer: int, timeout: float) -> bool:
        """Block until ``layer`` of ``job`` is in the paged cache; ``False`` on timeout."""
        return job.layer_done[layer].wait(timeout)

    @staticmethod
    def is_done(job: LoadJob) -> bool:
        """Whether every layer of ``job`` is done (never blocks)."""
        return job.done.is_set()

    @staticmethod
    def wait_done(job: LoadJob) -> None:
        """Block until ``job`` is done (cancel it first to make that quick)."""
        job.done.wait()

    def close(self) -> None:
        """Stop the thread after the queued jobs (cancel them first); blocks until it
        has exited. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._queue.put(None)
            self._thread.join()


class StreamLoader:
    """Queues load jobs on the device's load stream with one event per layer (CUDA).

    The copies are queued by :meth:`submit` itself (nothing to cancel afterwards);
    checksums, when enabled, are verified on the host before the copies are queued.
    """

    def __init__(
        self, pool: HostKVPool, kv_caches: Sequence[torch.Tensor], sync: DeviceSync
    ) -> None:
        self.pool = pool
        self.kv_caches = list(kv_caches)
        self.sync = sync

    def submit(self, job: LoadJob) -> None:
        """Verify (host), then queue every layer's copies after the compute stream's
        work so far; returns without waiting for the device."""
        try:
            if job.verify:
                for layer in range(len(self.kv_caches)):
                    job.fail(self.pool.verify_layer(layer, job.runs))
            ready = self.sync.record_event("offload-load-start")
            with self.sync.load_stream():
                self.sync.wait_event(ready)
                for layer, kv in enumerate(self.kv_caches):
                    self.pool.load_layer(layer, kv, job.runs)
                    job.device_events.append(self.sync.record_event(layer))
        except Exception as exc:
            log.error("offload: queueing loads failed", error=repr(exc))
            job.fail_all()
            job.device_events.clear()
        finally:
            job.finish()

    def wait_layer(self, job: LoadJob, layer: int, timeout: float) -> bool:
        """Make the current stream wait for ``layer``'s copies (the host does not wait)."""
        if layer < len(job.device_events):
            self.sync.wait_event(job.device_events[layer])
        return True

    @staticmethod
    def is_done(job: LoadJob) -> bool:
        """Whether the device finished every copy of ``job`` (never blocks)."""
        return all(event.query() for event in job.device_events)

    @staticmethod
    def wait_done(job: LoadJob) -> None:
        """Block until the device finished every copy of ``job``."""
        for event in job.device_events:
            event.synchronize()

    def close(self) -> None:
        """Nothing to stop (the streams belong to the device)."""
