"""One step's loads from the store, fetched and copied layer by layer off the forward
thread.

A :class:`RedisLoadJob` runs on the worker's loader thread: one pipelined ``GET`` of all
its blocks, a full verification of each value (``connectors.framing.decode_block``),
then one copy per layer into the paged cache, setting that layer's
``threading.Event`` as soon as it lands, so ``wait_for_layer_load(i)`` waits for layer
``i`` only. A block that is missing, corrupt, unsigned or wrongly signed (with a key) or
unreadable (server down, socket timeout) is a failed block, never an exception into a
waiter.

Cancellation (a timed-out wait, a failed step) takes the job's lock, which every layer
copy holds: once :meth:`RedisLoadJob.cancel` returns, the job writes nothing more into
the paged cache, so a late reply can never overwrite blocks that are being recomputed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import redis
import torch

from connectors.framing import decode_block
from connectors.integrity import FrameSigner
from connectors.redis_store.metadata import BlockTransfer
from connectors.redis_store.store import RateLimitedLog, RedisStore
from pipeline.artifacts import LoadFailureCause, LoadFailures
from pipeline.errors import FrameError
from pipeline.logger import get_logger

__all__ = ["RedisLoadJob"]

log = get_logger()


class RedisLoadJob:
    """The loads of one step. Thread-safe.

    Args:
        loads: The blocks to load.
        keys: The store key of each load (same order).
        frame_keys: The key each value must name (same order).
        kv_caches: The paged cache, one ``[2, num_blocks, block_size, h, d]`` per layer.
        deadline: ``time.monotonic()`` after which waiters give up.
        signer: With a key, every value must carry a valid tag (else a failed block).
    """

    def __init__(
        self,
        loads: Sequence[BlockTransfer],
        keys: Sequence[bytes],
        frame_keys: Sequence[bytes],
        kv_caches: Sequence[torch.Tensor],
        deadline: float,
        signer: FrameSigner | None = None,
    ) -> None:
        self.signer = signer
        self.loads = tuple(loads)
        self.keys = tuple(keys)
        self.frame_keys = tuple(frame_keys)
        self.kv_caches = list(kv_caches)
        self.deadline = deadline
        self.layer_done = [threading.Event() for _ in self.kv_caches]
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._cancelled = False
        self._failed: set[int] = set()
        self._causes: dict[int, LoadFailureCause] = {}  # a failed block's first cause

    @property
    def block_ids(self) -> frozenset[int]:
        """Every block the job loads."""
        return frozenset(t.block_id for t in self.loads)

    @property
    def failed_blocks(self) -> frozenset[int]:
        """Blocks that failed so far."""
        with self._lock:
            return frozenset(self._failed)

    @property
    def failures(self) -> LoadFailures:
        """The cause of each failed block: ``missing`` (no value), ``corrupt`` (it
        failed verification), ``read_timeout`` (the server did not answer in time, or
        the forward pass stopped waiting), ``read_error`` (the server is down or
        failed), ``unknown`` (the job itself failed)."""
        with self._lock:
            blocks: dict[LoadFailureCause, set[int]] = {}
            for block_id in self._failed:
                cause = self._causes.get(block_id, LoadFailureCause.UNKNOWN)
                blocks.setdefault(cause, set()).add(block_id)
        return LoadFailures(blocks=blocks)

    def _mark(self, block_ids: frozenset[int] | set[int], cause: LoadFailureCause) -> None:
        """Fail ``block_ids`` under ``cause`` (their first); under the lock."""
        self._failed |= block_ids
        for block_id in block_ids:
            self._causes.setdefault(block_id, cause)

    def cancel(self, *, fail: bool) -> None:
        """Stop copying (returns once no copy is in progress); with ``fail``, mark every
        block failed. Never blocks for longer than one layer's copy; idempotent."""
        with self._lock:
            self._cancelled = True
            if fail and not self.done.is_set():
                self._mark(self.block_ids, LoadFailureCause.READ_TIMEOUT)

    def wait_layer(self, layer: int) -> bool:
        """Block until ``layer`` is in the paged cache or the deadline passes."""
        return self.layer_done[layer].wait(max(0.0, self.deadline - time.monotonic()))

    def run(self, store: RedisStore, warn: RateLimitedLog) -> None:
        """Fetch, verify and copy (the loader thread). Never raises."""
        try:
            self._run(store, warn)
        except Exception as exc:  # a bug here must not hang the forward pass
            log.error("redis: load job failed", error=repr(exc))
            with self._lock:
                self._failed |= self.block_ids
        finally:
            for event in self.layer_done:
                event.set()
            self.done.set()

    def _run(self, store: RedisStore, warn: RateLimitedLog) -> None:
        with self._lock:
            if self._cancelled:
                return
        try:
            values = store.get_many(self.keys)
        except redis.RedisError as exc:
            warn.warning("redis: load failed", blocks=len(self.keys), error=repr(exc))
            timed_out = isinstance(exc, redis.TimeoutError)
            cause = LoadFailureCause.READ_TIMEOUT if timed_out else LoadFailureCause.READ_ERROR
            with self._lock:
                self._mark(self.block_ids, cause)
            return
        first = self.kv_caches[0]
        shape, dtype = tuple(first[:, 0].shape), first.dtype
        ok_ids: list[int] = []
        blocks: list[list[torch.Tensor]] = []
        bad: dict[int, LoadFailureCause] = {}
        for load, value, frame_key in zip(self.loads, values, self.frame_keys, strict=True):
            try:
                if value is None:
                    raise FrameError("value", "a stored block", "missing")
                layers = decode_block(
                    value,
                    frame_key,
                    num_layers=len(self.kv_caches),
                    layer_shape=shape,
                    dtype=dtype,
                    signer=self.signer,
                )
            except FrameError as exc:
                warn.warning("redis: bad value, load error", block_id=load.block_id, error=str(exc))
                missing = value is None
                bad[load.block_id] = (
                    LoadFailureCause.MISSING if missing else LoadFailureCause.CORRUPT
                )
                continue
            ok_ids.append(load.block_id)
            blocks.append(layers)
        with self._lock:
            for block_id, cause in bad.items():
                self._mark({block_id}, cause)
        if not ok_ids:
            return
        index = torch.tensor(ok_ids, dtype=torch.long, device=first.device)
        for layer, kv in enumerate(self.kv_caches):
            src = torch.stack([b[layer] for b in blocks], dim=1).to(kv.device)
            with self._lock:
                if self._cancelled:
                    return
                kv.index_copy_(1, index, src)
            self.layer_done[layer].set()
