"""``SharedStorageWorker``: the worker half of the shared_storage connector (one rank).

Per step, exactly what :class:`SharedStorageMetadata` says::

    start_load_kv        start this step's reads on a reader thread (layer 0 first)
    wait_for_layer_load  wait for that layer only, up to the step's load deadline;
                         past it, the load is abandoned and its blocks are load errors
    save_kv_layer        gather the saved blocks' layer (one copy out of the paged cache
                         to CPU); after the last layer, queue their writes on the writer
                         thread (off the forward path)
    wait_for_save        wait for the writes; return the requests whose write failed
                         (disk full, permission) or whose loads failed this step — an
                         I/O error is never raised
    clear                abandon a load a failed step left running (never blocks)

Step-level calls run on the event loop, layer hooks on the forward thread; shared state
is written before the forward starts or under a lock.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import ClassVar

import anyio
import anyio.to_thread
import attrs
import torch

from connectors.base import ConnectorContext, ForwardContext
from connectors.framing import encode_block
from connectors.shared_storage.loader import StoreLoad
from connectors.shared_storage.metadata import BlockRef, SharedStorageMetadata
from connectors.shared_storage.options import SharedStorageOptions
from connectors.shared_storage.store import DiskStore
from connectors.store.worker import StoreStep, StoreWorker, StoreWorkerStats
from pipeline.errors import StageError
from pipeline.logger import get_logger

__all__ = ["SharedStorageWorker", "SharedStorageWorkerStats"]

log = get_logger()


@attrs.frozen(kw_only=True)
class SharedStorageWorkerStats(StoreWorkerStats):
    """Blocks moved by one rank since it started (``SharedStorageWorker.stats``)."""


@attrs.define
class _Step(StoreStep):
    """One step's state (written on the loop before the forward, or under the lock)."""

    load_req: dict[int, str] = attrs.Factory(dict)
    writes: list[tuple[BlockRef, concurrent.futures.Future[None]]] = attrs.Factory(list)
    save_failed: set[str] = attrs.Factory(set)
    deadline: float = 0.0


class SharedStorageWorker(StoreWorker):
    """One rank's view of the store; see the module docstring for the per-step calls.

    Creating it removes stale temp files of crashed writers under ``path``.

    Raises:
        InvalidConfigError: Bad options, an unusable path, or no fingerprint.
    """

    name: ClassVar[str] = "shared_storage"
    stats_type: ClassVar[type[StoreWorkerStats]] = SharedStorageWorkerStats
    _step: _Step

    def __init__(self, context: ConnectorContext) -> None:
        options = SharedStorageOptions.from_options(context.options)  # before the fingerprint
        super().__init__(context)
        self.options = options
        self.store = DiskStore(self.options.path, allow_shared=self.options.allow_shared)
        self.store.clean_stale_temps(self.options.stale_temp_s)
        self._load: StoreLoad | None = None
        self._abandoned: list[StoreLoad] = []
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix=f"kvstep-shared-write-{context.rank}"
        )
        self._step = _Step()

    # -------------------------------------------------------------------- loads

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Start this step's reads on a reader thread; returns before they land.

        Raises:
            StageError: Metadata that is not :class:`SharedStorageMetadata`.
        """
        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata):
            reason = f"shared_storage needs SharedStorageMetadata, got {type(meta).__name__}"
            raise StageError("load", ctx.step_id, reason)
        if self._load is not None:  # a failed step left it: nothing may write any more
            self._load.abandon()
            self._load = None
        self._abandoned = [load for load in self._abandoned if not load.done.is_set()]
        saves = meta.saves()
        self._step = step = _Step(saves=saves, save_index=self._save_index(saves))
        step.deadline = time.monotonic() + self.options.load_timeout_s
        refs = meta.loads()
        if refs and self.kv_caches:
            step.load_req = {ref.block_id: ref.req_id for ref in refs}
            self._load = StoreLoad(
                self.store, self.fingerprint_key, refs, self.kv_caches, self.options.signer
            )
            self._load.start()

    def wait_for_layer_load(self, layer: int) -> None:
        """Block the forward thread until ``layer``'s loads are in the paged cache, at
        most until the step's load deadline; past it, abandon the load (its blocks are
        load errors and the reader never writes into the cache again)."""
        load = self._load
        if load is None or load.abandoned:
            return
        if not load.wait_layer(layer, self._step.deadline):
            log.warning(
                "shared_storage: load deadline passed; recomputing",
                layer=layer,
                timeout_s=self.options.load_timeout_s,
            )
            load.abandon()

    def _finish_load(self) -> None:
        """Fold this step's load outcome into the step (after the last layer's wait)."""
        load, step = self._load, self._step
        if load is None:
            return
        if not load.finished:
            return  # the forward has not waited for every layer: left to clear/abandon
        failed = load.failed_blocks
        with self._lock:
            step.load_errors |= failed
            step.load_failures = step.load_failures.merge(load.failures)
            step.loaded_blocks = len(load.refs) - len(failed)
            step.save_failed |= {step.load_req[b] for b in failed if b in step.load_req}
        if load.abandoned and not load.done.is_set():
            self._abandoned.append(load)
        self._load = None

    # -------------------------------------------------------------------- saves

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Copy this step's saved blocks of ``layer`` out of the paged cache (CPU); after
        the last layer, queue their writes. A copy that raises fails its requests' saves,
        never the step. Forward thread."""
        step = self._step
        if step.save_index is None:
            return
        try:
            self._gather(layer, kv_layer)
        except Exception as exc:
            log.error("shared_storage: save copy failed", layer=layer, error=repr(exc))
            with self._lock:
                step.save_failed |= {ref.req_id for ref in step.saves}
        if layer == len(self.kv_caches) - 1:
            self._finish_load()
            self._submit_writes(step)

    def _submit_writes(self, step: _Step) -> None:
        with self._lock:
            failed = set(step.save_failed)
        blocks = self._gathered_blocks()
        for ref, layers in zip(step.saves, blocks or [], strict=False):
            if ref.req_id in failed:
                continue
            future = self._writer.submit(self._write, ref, layers)
            step.writes.append((ref, future))
        step.gathered.clear()

    def _write(self, ref: BlockRef, layers: list[torch.Tensor]) -> None:
        """Frame and write one block (writer thread); skips values already stored."""
        if self.store.contains(self.fingerprint_key, ref.block_hash):
            return
        key = self.fingerprint_key.encode() + ref.block_hash
        data = encode_block(key, layers, signer=self.options.signer)
        self.store.write(self.fingerprint_key, ref.block_hash, data)

    async def wait_for_save(self) -> frozenset[str]:
        """Wait for this step's writes; return the requests whose write failed or whose
        loads failed this step (their new KV was computed on top of it). Never raises
        for an I/O error (it is logged). ``max_bytes`` is the scheduler half's to
        enforce (once per engine, after the step's saves landed)."""
        step = self._step
        self._finish_load()
        if step.writes:
            futures = [f for _, f in step.writes]
            await anyio.to_thread.run_sync(concurrent.futures.wait, futures)
        done = 0
        for ref, future in step.writes:
            exc = future.exception()
            if exc is None:
                done += 1
                continue
            log.error(
                "shared_storage: write failed",
                req_id=ref.req_id,
                block_hash=ref.block_hash.hex(),
                error=repr(exc),
            )
            with self._lock:
                step.save_failed.add(ref.req_id)
        step.saved_blocks = done
        with self._lock:
            failed = frozenset(step.save_failed)
        self._count(saved_blocks=done, failed_saves=len(failed))
        return failed

    # ----------------------------------------------------------------- per step

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks whose load failed this step (missing, corrupt, timeout)."""
        self._finish_load()
        step = self._step
        self._count(loaded_blocks=step.loaded_blocks, load_errors=len(step.load_errors))
        return frozenset(step.load_errors)

    def clear_connector_metadata(self) -> None:
        """Drop the metadata; abandon a load a failed step left running (it then never
        writes into the paged cache). Never blocks, never raises."""
        super().clear_connector_metadata()
        load = self._load
        if load is not None:
            load.abandon()
            if not load.done.is_set():
                self._abandoned.append(load)
            self._load = None

    async def aclose(self) -> None:
        """Abandon loads, finish queued writes, stop the threads. Idempotent; shielded
        from cancellation (it waits for the writes in progress)."""
        if self._closed:
            return
        self._closed = True
        loads = [*self._abandoned, *([self._load] if self._load is not None else [])]
        for load in loads:
            load.abandon()

        def stop() -> None:
            self._writer.shutdown(wait=True)
            for load in loads:
                load.join(timeout=5.0)

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop)
        self._load, self._abandoned = None, []
