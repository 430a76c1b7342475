"""``StoreWorker``: the worker half's common part of the store connectors (one rank).

What ``shared_storage`` and ``redis`` do alike: require a fingerprint, remember the
paged cache, gather the step's saved blocks layer by layer in ``save_kv_layer`` (one
CPU copy per layer), count loads and saves per step and since start, and report
``get_kv_stats`` and the causes of the load errors (``get_load_failures``). The loads
(threads, deadlines) and the writes stay in the subclasses.

Step-level calls run on the event loop, layer hooks on the forward thread; the totals
are guarded by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

import attrs
import torch

from connectors.base import ConnectorContext, KVConnectorWorker
from connectors.store.metadata import BlockRef, require_fingerprint
from pipeline.artifacts import KVStats, LoadFailures

__all__ = ["StoreStep", "StoreWorker", "StoreWorkerStats"]


@attrs.frozen(kw_only=True)
class StoreWorkerStats:
    """Blocks moved by one rank since it started (``StoreWorker.stats``)."""

    loaded_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    failed_saves: int = 0


@attrs.define
class StoreStep:
    """One step's common state; written on the loop before the forward starts (the
    gathered layers by the forward thread, read after it)."""

    saves: list[BlockRef] = attrs.Factory(list)
    save_index: torch.Tensor | None = None  # the saved blocks' ids, on the cache device
    gathered: dict[int, torch.Tensor] = attrs.Factory(dict)  # layer -> [2, n, bs, h, d]
    load_errors: set[int] = attrs.Factory(set)
    load_failures: LoadFailures = attrs.Factory(LoadFailures)  # the causes of load_errors
    loaded_blocks: int = 0
    saved_blocks: int = 0


class StoreWorker(KVConnectorWorker):
    """The common part of a store connector's worker half (module docstring).

    Subclasses set ``name`` and ``stats_type`` and assign ``self._step`` a
    :class:`StoreStep` (or a subclass) at each ``start_load_kv``.

    Raises:
        InvalidConfigError: No fingerprint in ``context`` (blocks are keyed by the model).
    """

    name: ClassVar[str] = "store"
    stats_type: ClassVar[type[StoreWorkerStats]] = StoreWorkerStats

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.fingerprint_key = require_fingerprint(context, self.name).key()
        self.block_size = context.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.block_bytes = 0
        self._step = StoreStep()
        self._lock = threading.Lock()
        self._totals: dict[str, int] = dict.fromkeys(attrs.fields_dict(StoreWorkerStats), 0)
        self._closed = False

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Remember the paged cache (one ``[2, num_blocks, block_size, heads, dim]``
        tensor per layer). Never blocks."""
        self.kv_caches = list(kv_caches)
        if self.kv_caches:
            one = self.kv_caches[0][:, 0]
            self.block_bytes = one.numel() * one.element_size() * len(self.kv_caches)

    @property
    def stats(self) -> StoreWorkerStats:
        """Totals since start (thread-safe snapshot)."""
        with self._lock:
            return self.stats_type(**self._totals)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._totals[name] += delta

    def _save_index(self, saves: Sequence[BlockRef]) -> torch.Tensor | None:
        """The block ids of ``saves`` on the paged cache's device (``None`` if none)."""
        if not saves or not self.kv_caches:
            return None
        ids = [ref.block_id for ref in saves]
        return torch.tensor(ids, dtype=torch.long, device=self.kv_caches[0].device)

    def _gather(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy this step's saved blocks of ``layer`` to CPU (forward thread; on CUDA it
        waits for the layer's compute). May raise what the copy raises."""
        index = self._step.save_index
        if index is not None:
            self._step.gathered[layer] = kv_layer.index_select(1, index).to("cpu")

    def _gathered_blocks(self) -> list[list[torch.Tensor]] | None:
        """Per saved block, its layers (``[2, bs, h, d]`` views); ``None`` unless every
        layer was gathered."""
        step = self._step
        if len(step.gathered) != len(self.kv_caches):
            return None
        layers = [step.gathered[i] for i in range(len(self.kv_caches))]
        return [[kv[:, n] for kv in layers] for n in range(len(step.saves))]

    def get_load_failures(self) -> LoadFailures:
        """The causes of this step's load errors (``StoreStep.load_failures``)."""
        return self._step.load_failures

    def get_kv_stats(self) -> KVStats:
        """This step's loaded and saved blocks, in tokens and bytes."""
        step, bs, nbytes = self._step, self.block_size, self.block_bytes
        loaded, saved = step.loaded_blocks, step.saved_blocks
        return KVStats(
            loaded_tokens=loaded * bs,
            loaded_bytes=loaded * nbytes,
            saved_tokens=saved * bs,
            saved_bytes=saved * nbytes,
        )
