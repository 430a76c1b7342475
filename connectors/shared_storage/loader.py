"""``StoreLoad``: one step's reads from the store into the paged cache, layer by layer.

A load runs on its own daemon thread. It opens every distinct value once (blocks of
several requests sharing a prefix share it) and verifies its
header, then for layer 0, 1, ... reads that layer of every block (lazy per-layer reads,
each checksum verified) and copies it into the paged cache, then sets the layer's
``threading.Event`` so ``wait_for_layer_load(i)`` waits for layer ``i`` only.

A block that is missing, truncated, corrupt, unsigned or wrongly signed (with a key),
or not a regular file (a planted symlink) is a load error (logged), never wrong data.
A load the forward thread gave up on (deadline) is **abandoned**: under the load's lock
the abandoned flag is set, and the reader checks that flag under the same lock before
each copy into the paged cache, so once :meth:`StoreLoad.abandon` returns, the reader
never writes into the cache again; it exits by itself at its next check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import torch

from connectors.framing import iter_layers
from connectors.integrity import FrameSigner
from connectors.shared_storage.metadata import BlockRef
from connectors.shared_storage.store import DiskStore
from pipeline.artifacts import LoadFailureCause, LoadFailures
from pipeline.errors import FrameError, InvalidConfigError
from pipeline.logger import get_logger

__all__ = ["StoreLoad", "open_block"]

log = get_logger()

_Layers = Iterator[tuple[int, torch.Tensor]]


def open_block(
    store: DiskStore,
    fp_key: str,
    ref: BlockRef,
    layer_shape: tuple[int, ...],
    dtype: torch.dtype,
    num_layers: int,
    signer: FrameSigner | None = None,
) -> _Layers:
    """A verified per-layer reader of one block's value (header checked on open; with
    ``signer``, the tag checked before the last layer is yielded).

    Tests replace this (module attribute) to make the store slow or faulty.

    Raises:
        FrameError: The header does not match; OSError: missing or unreadable.
    """
    path = store.path_for(fp_key, ref.block_hash)
    key = fp_key.encode() + ref.block_hash
    layers = iter_layers(
        path, key, num_layers=num_layers, layer_shape=layer_shape, dtype=dtype, signer=signer
    )
    # Prime the generator: opens the file and verifies the header before layer 0's read.
    first = next(layers)
    store.touch(path)

    def chain() -> _Layers:
        yield first
        yield from layers

    return chain()


class StoreLoad:
    """One step's loads. Thread-safe: its state is read and written across threads.

    Args:
        store: The store to read.
        fp_key: This rank's fingerprint key.
        refs: The blocks to load.
        kv_caches: The paged cache, one tensor per layer.
        signer: With a key, every value must carry a valid tag.
    """

    def __init__(
        self,
        store: DiskStore,
        fp_key: str,
        refs: Sequence[BlockRef],
        kv_caches: Sequence[torch.Tensor],
        signer: FrameSigner | None = None,
    ) -> None:
        self.store = store
        self.signer = signer
        self.fp_key = fp_key
        self.refs = tuple(refs)
        self.kv_caches = list(kv_caches)
        self.layer_done = [threading.Event() for _ in self.kv_caches]
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._failed: set[int] = set()
        self._causes: dict[int, LoadFailureCause] = {}  # a failed block's first cause
        self._thread = threading.Thread(target=self._run, name="kvstep-shared-load", daemon=True)

    def start(self) -> None:
        """Start the reader thread; returns at once."""
        self._thread.start()

    @property
    def abandoned(self) -> bool:
        with self._lock:
            return self._abandoned

    def abandon(self) -> None:
        """Give up: every block not loaded yet fails, and the reader never copies into
        the paged cache after this returns. Never blocks for long; idempotent."""
        with self._lock:
            self._abandoned = True
            self._failed |= {ref.block_id for ref in self.refs}
            self._cause_rest(LoadFailureCause.READ_TIMEOUT)
        for event in self.layer_done:
            event.set()

    @property
    def finished(self) -> bool:
        """Whether the outcome is final: every layer landed (the reader copies nothing
        more) or the load was abandoned."""
        return self.layer_done[-1].is_set() if self.layer_done else True

    @property
    def failed_blocks(self) -> frozenset[int]:
        """Blocks that failed to load (final once ``done`` is set or after abandon)."""
        with self._lock:
            return frozenset(self._failed)

    @property
    def failures(self) -> LoadFailures:
        """The cause of each failed block: ``missing`` (no such value), ``corrupt`` (it
        failed verification), ``read_error`` (unreadable), ``read_timeout`` (not
        loaded by the step's deadline), ``unknown`` (the reader itself failed)."""
        with self._lock:
            blocks: dict[LoadFailureCause, set[int]] = {}
            for block_id, cause in self._causes.items():
                blocks.setdefault(cause, set()).add(block_id)
        return LoadFailures(blocks=blocks)

    def _cause_rest(self, cause: LoadFailureCause) -> None:
        """Give ``cause`` to the failed blocks without one (under the lock)."""
        for block_id in self._failed:
            self._causes.setdefault(block_id, cause)

    def _fail(self, ref: BlockRef, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            cause = LoadFailureCause.MISSING
        elif isinstance(exc, OSError):
            cause = LoadFailureCause.READ_ERROR
        else:  # FrameError, a wrong shape or dtype (InvalidConfigError), a short value
            cause = LoadFailureCause.CORRUPT
        with self._lock:
            self._failed.add(ref.block_id)
            self._causes.setdefault(ref.block_id, cause)
        level = log.info if isinstance(exc, FileNotFoundError) else log.warning
        level(
            "shared_storage: block load failed",
            block_id=ref.block_id,
            req_id=ref.req_id,
            block_hash=ref.block_hash.hex(),
            error=repr(exc),
        )

    def _run(self) -> None:
        try:
            self._read_all()
        except BaseException as exc:  # never leave a waiter behind
            log.error("shared_storage: loader failed", error=repr(exc))
            with self._lock:
                self._failed |= {ref.block_id for ref in self.refs}
                self._cause_rest(LoadFailureCause.UNKNOWN)
        finally:
            for event in self.layer_done:
                event.set()
            self.done.set()

    def _read_all(self) -> None:
        kv0 = self.kv_caches[0]
        shape, dtype, n = tuple(kv0[:, 0].shape), kv0.dtype, len(self.kv_caches)
        # Requests sharing a prefix load the same value into several blocks: each value
        # is read (and verified) once and copied to every block that wants it.
        groups: dict[bytes, list[BlockRef]] = {}
        for ref in self.refs:
            groups.setdefault(ref.block_hash, []).append(ref)
        readers: dict[bytes, _Layers] = {}
        for block_hash, refs in groups.items():
            if self.abandoned:
                return
            try:
                readers[block_hash] = open_block(
                    self.store, self.fp_key, refs[0], shape, dtype, n, self.signer
                )
            except (OSError, FrameError, InvalidConfigError, StopIteration) as exc:
                for ref in refs:
                    self._fail(ref, exc)
        for layer, kv in enumerate(self.kv_caches):
            for block_hash, reader in list(readers.items()):
                refs = groups[block_hash]
                try:
                    got, tensor = next(reader)
                    if got != layer:
                        raise FrameError("layer order", layer, got)
                except (OSError, FrameError, StopIteration) as exc:
                    for ref in refs:
                        self._fail(ref, exc)
                    del readers[block_hash]
                    continue
                with self._lock:
                    if self._abandoned:
                        return
                    for ref in refs:
                        if ref.block_id not in self._failed:
                            kv[:, ref.block_id].copy_(tensor)
            self.layer_done[layer].set()

    def wait_layer(self, layer: int, deadline: float) -> bool:
        """Block until ``layer`` is in the paged cache; ``False`` past ``deadline``
        (a ``time.monotonic()`` value)."""
        return self.layer_done[layer].wait(max(0.0, deadline - time.monotonic()))

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reader thread to exit (bounded by ``timeout``)."""
        if self._thread.is_alive():
            self._thread.join(timeout)
