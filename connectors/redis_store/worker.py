"""``RedisWorker``: the worker half of the redis connector (one rank).

Per step, exactly what the scheduler half's :class:`RedisMetadata` says::

    start_load_kv        queue the step's loads on the loader thread (one pipelined GET,
                         verify every value, copy layer by layer); returns at once
    wait_for_layer_load  wait for that layer only, until the step's load deadline
                         (``load_timeout_s`` after start_load_kv); a timeout fails the
                         step's loads (they are recomputed) instead of hanging
    save_kv_layer        gather the step's finished blocks of that layer (a CPU copy)
    wait_for_save        frame the gathered blocks and write them (one pipelined SET
                         with the TTL) on a thread; returns the requests whose save failed
                         (server down or slow, or their loads failed) and never raises
    clear                cancel what a failed step left running (never blocks long)

The step-level calls run on the event loop, the layer hooks on the forward thread.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import anyio
import anyio.to_thread
import attrs
import redis
import torch

from connectors.base import ConnectorContext, ForwardContext, WorkerFinished
from connectors.framing import encode_block
from connectors.redis_store.loader import RedisLoadJob
from connectors.redis_store.metadata import BlockTransfer, RedisMetadata
from connectors.redis_store.options import RedisOptions
from connectors.redis_store.store import RateLimitedLog, RedisStore, store_key
from connectors.store.worker import StoreStep, StoreWorker, StoreWorkerStats
from pipeline.errors import StageError

__all__ = ["RedisWorker", "RedisWorkerStats"]


@attrs.frozen(kw_only=True)
class RedisWorkerStats(StoreWorkerStats):
    """Blocks moved by one rank since it started (``RedisWorker.stats``)."""


@attrs.define
class _Step(StoreStep):
    collected: bool = False


class RedisWorker(StoreWorker):
    """One rank's reads and writes of the store; see the module docstring.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    name: ClassVar[str] = "redis"
    stats_type: ClassVar[type[StoreWorkerStats]] = RedisWorkerStats
    _step: _Step

    def __init__(self, context: ConnectorContext) -> None:
        options = RedisOptions.from_options(context.options)  # before the fingerprint
        super().__init__(context)
        self.options = options
        self.store = RedisStore(self.options, self.options.load_timeout_s)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix=f"kvstep-redis-{context.rank}")
        self._job: RedisLoadJob | None = None
        self._step = _Step()
        self._warn = RateLimitedLog()

    def key(self, block_hash: bytes) -> bytes:
        """The store key of one of this rank's blocks."""
        return store_key(self.options.key_prefix, self.fingerprint_key, block_hash)

    def frame_key(self, block_hash: bytes) -> bytes:
        """The key a stored value names: this rank's fingerprint + the block hash."""
        return self.fingerprint_key.encode() + b":" + block_hash

    # -------------------------------------------------------------------- loads

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Queue the step's loads; returns before they land. Never blocks.

        Raises:
            StageError: Metadata that is not :class:`RedisMetadata`, or no paged cache.
        """
        meta = self._metadata
        if not isinstance(meta, RedisMetadata) or not self.kv_caches:
            reason = f"redis needs its paged cache and RedisMetadata, got {type(meta).__name__}"
            raise StageError("load", ctx.step_id, reason)
        if self._job is not None:  # a step whose clear never ran: stop its copies
            self._job.cancel(fail=False)
            self._job = None
        saves = meta.saves()
        self._step = _Step(saves=saves, save_index=self._save_index(saves))
        loads = meta.loads()
        if not loads:
            return
        job = RedisLoadJob(
            loads,
            [self.key(t.block_hash) for t in loads],
            [self.frame_key(t.block_hash) for t in loads],
            self.kv_caches,
            deadline=time.monotonic() + self.options.load_timeout_s,
            signer=self.options.signer,
        )
        self._job = job
        self._loader.submit(job.run, self.store, self._warn)

    def wait_for_layer_load(self, layer: int) -> None:
        """Block the forward thread until ``layer``'s loads are in the paged cache, or
        the step's load deadline passes (then every load of the step fails and no copy
        of it lands afterwards). Forward thread; never raises."""
        job = self._job
        if job is None or job.done.is_set():
            return
        if not job.wait_layer(layer):
            self._warn.warning("redis: load timed out, recomputing", layer=layer)
            job.cancel(fail=True)

    def _collect_loads(self) -> None:
        step, job = self._step, self._job
        if step.collected:
            return
        step.collected = True
        if job is None:
            return
        failed = job.failed_blocks
        step.load_errors |= failed
        step.load_failures = step.load_failures.merge(job.failures)
        step.loaded_blocks = len(job.loads) - len(failed)
        self._count(loaded_blocks=step.loaded_blocks, load_errors=len(failed))

    # -------------------------------------------------------------------- saves

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Gather this step's saved blocks of ``layer`` (a CPU copy; on CUDA it waits for
        the layer's compute). Forward thread; the network write happens in
        ``wait_for_save``, off the forward path."""
        self._gather(layer, kv_layer)

    def _write(self, blocks: list[list[torch.Tensor]], saves: list[BlockTransfer]) -> None:
        position = {t.block_id: n for n, t in enumerate(self._step.saves)}
        items = []
        for save in saves:
            layers = blocks[position[save.block_id]]
            value = encode_block(
                self.frame_key(save.block_hash), layers, signer=self.options.signer
            )
            items.append((self.key(save.block_hash), value))
        self.store.set_many(items)

    async def wait_for_save(self) -> frozenset[str]:
        """Write the step's gathered blocks (on a thread); return the requests whose
        save failed, including those whose loads failed this step (their new KV was
        computed on top of it). Never raises; not cancellable while writing."""
        step = self._step
        self._collect_loads()
        job = self._job
        bad_load = {t.req_id for t in job.loads if t.block_id in step.load_errors} if job else set()
        saves = [t for t in step.saves if t.req_id not in bad_load]
        failed = {t.req_id for t in step.saves if t.req_id in bad_load}
        blocks = self._gathered_blocks()
        if saves:
            if blocks is None:
                failed |= {t.req_id for t in saves}
            else:
                try:
                    await anyio.to_thread.run_sync(self._write, blocks, saves)
                    step.saved_blocks = len(saves)
                except (redis.RedisError, ValueError) as exc:
                    self._warn.warning("redis: save failed", blocks=len(saves), error=repr(exc))
                    failed |= {t.req_id for t in saves}
        step.gathered.clear()
        self._count(saved_blocks=step.saved_blocks, failed_saves=len(failed))
        return frozenset(failed)

    # ----------------------------------------------------------------- per step

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """Nothing completes across steps: loads land within their step."""
        return WorkerFinished()

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks whose load failed this step (missing, corrupt, server down, timeout)."""
        self._collect_loads()
        return frozenset(self._step.load_errors)

    def clear_connector_metadata(self) -> None:
        """Drop the metadata and cancel the step's loads if still running (no copy of
        them lands afterwards). Never raises; blocks at most one layer's copy."""
        super().clear_connector_metadata()
        job, self._job = self._job, None
        if job is not None:
            job.cancel(fail=False)
        self._step.gathered.clear()

    async def aclose(self) -> None:
        """Cancel the loads, stop the loader thread, close the client. Idempotent;
        shielded from cancellation (waits at most about ``load_timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        if self._job is not None:
            self._job.cancel(fail=True)
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._loader.shutdown, True)
        finally:
            self._job = None
            self.store.close()
