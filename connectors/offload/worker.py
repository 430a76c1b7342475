"""``OffloadWorker``: the worker half of the offload connector (one rank's host pool).

Per step, exactly what the scheduler half's :class:`OffloadMetadata` says::

    start_load_kv        check each load's slot key (fingerprint + block hash; a mismatch
                         is a load error, never wrong data), start the loads (layer 0
                         first) on the loader thread / load stream
    wait_for_layer_load  wait for that layer only (forward thread)
    save_kv_layer        copy the step's finished blocks of that layer into their slots
    wait_for_save        record the slots' keys; report requests whose save failed (a
                         copy raised, or the request's loads failed this step)
    get_finished         async loads that completed (``recving``)
    clear                cancel what a failed step left running (never blocks)

The step-level calls run on the event loop, the layer hooks on the forward thread;
shared state is written before the forward starts or under a lock.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

import anyio
import anyio.to_thread
import attrs
import torch

from connectors.base import ConnectorContext, ForwardContext, KVConnectorWorker, WorkerFinished
from connectors.offload.metadata import BlockCopy, OffloadMetadata
from connectors.offload.options import OffloadOptions
from connectors.offload.pool import HostKVPool, make_runs
from connectors.offload.state import OffloadWorkerStats, StepState
from connectors.offload.transfer import LoadJob, StreamLoader, ThreadLoader
from connectors.store.metadata import require_fingerprint
from pipeline.artifacts import KVStats
from pipeline.device_sync import DeviceSync, make_device_sync
from pipeline.errors import InvalidConfigError, StageError
from pipeline.logger import get_logger

__all__ = ["OffloadWorker"]

log = get_logger()


class OffloadWorker(KVConnectorWorker):
    """One rank's host-memory tier; see the module docstring for the per-step calls.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = OffloadOptions.from_options(context.options)
        self.key_prefix = require_fingerprint(context, "offload").key().encode()
        self.block_size = context.block_size
        self.pool: HostKVPool | None = None
        self._loader: ThreadLoader | StreamLoader | None = None
        self._async_loader: ThreadLoader | StreamLoader | None = None
        self._device = torch.device("cpu")
        self._sync: DeviceSync | None = None  # CUDA only
        self._job: LoadJob | None = None
        self._async_jobs: dict[str, LoadJob] = {}
        self._step = StepState()
        self._lock = threading.Lock()
        self._totals: dict[str, int] = dict.fromkeys(attrs.fields_dict(OffloadWorkerStats), 0)
        self._closed = False

    # -------------------------------------------------------------------- setup

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Allocate the host pool (``num_blocks`` slots shaped like one block of every
        layer; pinned for a CUDA cache) and the loaders. Blocks while allocating.

        Raises:
            InvalidConfigError: ``block_bytes`` was given and differs from this cache's
                bytes per block, or the cache has an unexpected shape.
        """
        if kv_caches and self.options.block_bytes is not None:
            actual = kv_caches[0][:, 0].numel() * kv_caches[0].element_size() * len(kv_caches)
            if actual != self.options.block_bytes:
                raise InvalidConfigError(
                    "connector_options['block_bytes']",
                    self.options.block_bytes,
                    f"must equal this model's KV bytes per block, {actual}",
                )
        pool = HostKVPool.allocate(
            kv_caches, self.options.num_blocks, checksums=self.options.verify_checksum
        )
        self.pool, self._device = pool, kv_caches[0].device
        if self._device.type == "cuda":
            self._sync = make_device_sync(self._device)
            self._loader = StreamLoader(pool, kv_caches, self._sync)
            self._async_loader = self._loader
        else:
            rank = self.context.rank
            self._loader = ThreadLoader(pool, kv_caches, f"kvstep-offload-load-{rank}")
            self._async_loader = ThreadLoader(pool, kv_caches, f"kvstep-offload-async-{rank}")
        log.debug("offload pool ready", slots=pool.num_slots, block_bytes=pool.block_bytes)

    @property
    def stats(self) -> OffloadWorkerStats:
        """Totals since start (thread-safe snapshot)."""
        with self._lock:
            return OffloadWorkerStats(**self._totals)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._totals[name] += delta

    # -------------------------------------------------------------------- loads

    async def _finish(self, job: LoadJob) -> None:
        """Cancel ``job`` and wait until nothing of it still runs (off the loop)."""
        assert self._loader is not None
        job.cancel()
        if not self._loader.is_done(job):
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._loader.wait_done, job)

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Check every load's slot key, then start the loads; returns before they land.

        First finishes what a failed previous step left running and cancels async loads
        of requests that ended, so no stale copy can write into a reused block.

        Raises:
            StageError: No pool yet, or metadata that is not :class:`OffloadMetadata`.
        """
        meta, pool, loader = self._metadata, self.pool, self._loader
        if not isinstance(meta, OffloadMetadata) or pool is None or loader is None:
            reason = f"offload needs its pool and OffloadMetadata, got {type(meta).__name__}"
            raise StageError("load", ctx.step_id, reason)
        if self._job is not None:
            await self._finish(self._job)
            self._job = None
        for req_id in ctx.scheduler_output.finished_req_ids & self._async_jobs.keys():
            await self._finish(self._async_jobs.pop(req_id))
        self._step = step = StepState()
        async_ids = set(meta.async_req_ids)
        sync_loads: list[BlockCopy] = []
        async_loads: dict[str, list[BlockCopy]] = defaultdict(list)
        bad_reqs: set[str] = set()
        for copy in meta.loads():
            if copy.req_id in async_ids and copy.req_id in self._async_jobs:
                continue  # re-sent after a failed step; already in flight
            if pool.keys[copy.slot] != self.key_prefix + copy.block_hash:
                step.load_errors.add(copy.block_id)
                bad_reqs.add(copy.req_id)
            elif copy.req_id in async_ids:
                async_loads[copy.req_id].append(copy)
            else:
                sync_loads.append(copy)
                step.load_req[copy.block_id] = copy.req_id
        for req_id in async_ids - self._async_jobs.keys():
            self._async_jobs[req_id] = job = self._new_job(async_loads.get(req_id, []))
            self._async_loader.submit(job)  # type: ignore[union-attr]
        if step.load_errors:
            log.warning("offload: slot key mismatch", blocks=sorted(step.load_errors))
        self._prepare_saves(meta, pool, bad_reqs)
        if sync_loads:
            self._job = job = self._new_job(sync_loads)
            if job.verify and isinstance(loader, StreamLoader):
                await anyio.to_thread.run_sync(loader.submit, job)  # host-side verify
            else:
                loader.submit(job)

    def _new_job(self, loads: list[BlockCopy]) -> LoadJob:
        runs = make_runs((c.slot, c.block_id, c.req_id) for c in loads)
        req_ids = frozenset(c.req_id for c in loads)
        assert self.pool is not None
        return LoadJob(runs, len(self.pool.layers), req_ids, self.options.verify_checksum)

    def _prepare_saves(self, meta: OffloadMetadata, pool: HostKVPool, bad: set[str]) -> None:
        step = self._step
        for copy in meta.saves():
            pool.keys[copy.slot] = None  # invalid until this save is known to be complete
            if copy.req_id in bad:  # computed on top of KV that failed to load
                step.save_failed.add(copy.req_id)
            else:
                step.saves.append(copy)
        step.save_runs = make_runs((c.slot, c.block_id, c.req_id) for c in step.saves)

    def wait_for_layer_load(self, layer: int) -> None:
        """Block the forward thread until ``layer``'s loads of this step are in the paged
        cache (on CUDA: order the compute stream after them). A load that does not land
        within ``load_timeout_s`` is reported as failed instead of hanging."""
        job = self._job
        if job is None or self._loader is None:
            return
        if not self._loader.wait_layer(job, layer, self.options.load_timeout_s):
            log.error("offload: layer load timed out", layer=layer)
            job.fail_all()

    # -------------------------------------------------------------------- saves

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Copy this step's saved blocks of ``layer`` into their slots (on CUDA: queued
        on the save stream after the layer's compute). A copy that raises fails the
        requests of its run, never the step. Forward thread."""
        step, sync = self._step, self._sync
        if not step.save_runs:
            return
        if sync is None:
            self._save_runs(layer, kv_layer, step)
            return
        ready = sync.record_event(layer)  # on the compute stream: the layer's K/V written
        with sync.save_stream():
            sync.wait_event(ready)
            self._save_runs(layer, kv_layer, step)
            step.save_events.append(sync.record_event(("offload-save", layer)))

    def _save_runs(self, layer: int, kv_layer: torch.Tensor, step: StepState) -> None:
        assert self.pool is not None
        for run in step.save_runs:
            try:
                self.pool.save_layer(layer, kv_layer, [run])
            except Exception as exc:
                log.error("offload: save copy failed", layer=layer, error=repr(exc))
                with self._lock:
                    step.save_failed |= run.req_ids

    async def wait_for_save(self) -> frozenset[str]:
        """Wait for this step's saves, record their slots' keys (and checksums), and
        return the requests whose save failed, including requests whose loads failed
        this step (their new KV was computed on top of it)."""
        step, pool = self._step, self.pool
        if step.save_events:
            await anyio.to_thread.run_sync(step.save_events[-1].synchronize)
        job = self._job
        if job is not None:
            failed_loads = job.failed_blocks
            step.load_errors |= failed_loads
            step.loaded_blocks += job.num_blocks - len(failed_loads)
            step.save_failed |= {step.load_req[b] for b in failed_loads if b in step.load_req}
        with self._lock:
            failed = frozenset(step.save_failed)
        done = [c for c in step.saves if c.req_id not in failed]
        if pool is not None and done:
            if pool.sums is not None:
                runs = make_runs((c.slot, c.block_id, c.req_id) for c in done)
                await anyio.to_thread.run_sync(pool.record_checksums, runs)
            for copy in done:
                pool.keys[copy.slot] = self.key_prefix + copy.block_hash
        step.saved_blocks = len(done)
        self._count(saved_blocks=len(done), failed_saves=len(failed))
        return failed

    # ----------------------------------------------------------------- per step

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """Async loads that completed since the previous call (their failed blocks are
        reported by this step's ``get_block_ids_with_load_errors``)."""
        step, recving = self._step, set()
        loader = self._async_loader
        for req_id, job in list(self._async_jobs.items()):
            if loader is not None and loader.is_done(job):
                del self._async_jobs[req_id]
                failed = job.failed_blocks
                step.load_errors |= failed
                step.loaded_blocks += job.num_blocks - len(failed)
                recving.add(req_id)
        self._count(loaded_blocks=step.loaded_blocks, load_errors=len(step.load_errors))
        return WorkerFinished(recving=frozenset(recving))

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks whose load failed this step (key mismatch, checksum, copy, timeout)."""
        return frozenset(self._step.load_errors)

    def get_kv_stats(self) -> KVStats:
        """This step's loaded and saved blocks, in tokens and bytes."""
        step = self._step
        block_bytes = self.pool.block_bytes if self.pool is not None else 0
        loaded, saved = step.loaded_blocks, step.saved_blocks
        bs = self.block_size
        return KVStats(
            loaded_tokens=loaded * bs,
            loaded_bytes=loaded * block_bytes,
            saved_tokens=saved * bs,
            saved_bytes=saved * block_bytes,
        )

    def clear_connector_metadata(self) -> None:
        """Drop the metadata; cancel this step's loads if a failure left them running
        (the next ``start_load_kv`` waits for them). Never blocks, never raises."""
        super().clear_connector_metadata()
        job, loader = self._job, self._loader
        if job is not None and loader is not None:
            if loader.is_done(job):
                self._job = None
            else:
                job.cancel()

    async def aclose(self) -> None:
        """Cancel every load, stop the loader threads and drop the pool. Idempotent;
        shielded from cancellation (it only waits for the copy in progress)."""
        if self._closed:
            return
        self._closed = True
        jobs = [self._job, *self._async_jobs.values()]
        for job in jobs:
            if job is not None:
                job.cancel()
        loaders = {id(x): x for x in (self._loader, self._async_loader) if x is not None}
        try:
            with anyio.CancelScope(shield=True):
                for loader in loaders.values():
                    await anyio.to_thread.run_sync(loader.close)
        finally:
            self._job, self._async_jobs, self.pool = None, {}, None
