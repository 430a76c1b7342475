"""``MultiWorker``: the worker half of the multi (tiered) connector.

Every call fans out to every tier in tier order, each in its own ``try``: a tier that
raises is logged and the others still get the call. What a failure means is kept, never
dropped:

* a tier whose ``bind_connector_metadata``, ``start_load_kv`` or ``wait_for_layer_load``
  raised (or that got no metadata) may not have loaded its blocks: they are reported by
  ``get_block_ids_with_load_errors`` (the engine recomputes or fails those requests);
* a tier whose bind or ``start_load_kv`` raised sits out the rest of the step (only its
  clear is called): its per-step state may be stale, so it must not save;
* a tier that did not save as its metadata said (``start_load_kv``, ``save_kv_layer`` or
  ``wait_for_save`` raised) may hold partial KV: every request of the step is reported
  as a failed save, so no scheduler half commits them (conservative: a failure report
  carries request ids, not tiers, so the healthy tiers drop that step's saves too);
* ``clear_connector_metadata`` reaches every tier no matter what.

Layer hooks run on the forward thread, the other calls on the event loop; the per-step
failure state is written under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import attrs

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorker,
    WorkerFinished,
)
from connectors.multi.metadata import MultiMetadata
from connectors.multi.options import MultiOptions
from connectors.options import options_scope, options_where
from connectors.registry import create_connector
from pipeline.artifacts import KVStats
from pipeline.errors import StageError
from pipeline.logger import get_logger

if TYPE_CHECKING:
    import torch

    from pipeline.artifacts import LoadFailures

__all__ = ["MultiWorker"]

log = get_logger()


class MultiWorker(KVConnectorWorker):
    """One rank's tiers (see the module docstring).

    Attributes:
        tiers: Each tier's worker half (unguarded: the guard wraps this object).

    Raises:
        InvalidConfigError: Bad options, or a tier's own.
        UnknownConnectorError: A tier names an unregistered connector.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = MultiOptions.from_options(context.options)
        where = options_where()
        tiers: list[KVConnectorWorker] = []
        for i, spec in enumerate(self.options.tiers):
            with options_scope(f"{where}['tiers'][{i}]['options']"):
                tiers.append(
                    create_connector(
                        spec.connector,
                        KVConnectorRole.WORKER,
                        attrs.evolve(context, options=dict(spec.options)),
                    )
                )
        self.tiers: tuple[KVConnectorWorker, ...] = tuple(tiers)
        self._lock = threading.Lock()
        self._active: tuple[int, ...] = ()  # tiers bound this step
        self._load_errors: set[int] = set()  # blocks of tiers that failed to load
        self._save_broken = False
        self._ctx: ForwardContext | None = None
        self._closed = False

    def _failed(self, call: str, tier: int, exc: Exception) -> None:
        log.error("multi: tier call failed", call=call, tier=tier, error=repr(exc))

    def _loads_failed(self, tier: int) -> None:
        meta = self._metadata
        if isinstance(meta, MultiMetadata):
            with self._lock:
                self._load_errors.update(meta.load_block_ids[tier])

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Give every tier the paged cache. At start only; a tier's error propagates
        (a tier that cannot use this cache is a configuration error)."""
        for tier in self.tiers:
            tier.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Bind each tier's part; a tier without metadata, or whose bind raises, sits
        the step out and its loads are reported as failed. Never blocks.

        Raises:
            StageError: ``metadata`` is not a :class:`MultiMetadata` for these tiers.
        """
        if not isinstance(metadata, MultiMetadata) or len(metadata.tiers) != len(self.tiers):
            step_id = getattr(metadata, "step_id", -1)
            reason = f"multi needs MultiMetadata for {len(self.tiers)} tiers, got {metadata!r}"
            raise StageError("bind", step_id, reason)
        super().bind_connector_metadata(metadata)
        self._load_errors, self._save_broken, self._ctx = set(), False, None
        active: list[int] = []
        for i, (tier, meta) in enumerate(zip(self.tiers, metadata.tiers, strict=True)):
            try:
                if meta is None:
                    raise StageError("bind", metadata.step_id, f"tier {i} built no metadata")
                tier.bind_connector_metadata(meta)
            except Exception as exc:
                self._failed("bind_connector_metadata", i, exc)
                self._loads_failed(i)
                continue
            active.append(i)
        self._active = tuple(active)

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Start every bound tier's loads. Cancellation-safe as the tiers are."""
        self._ctx = ctx
        for i in tuple(self._active):
            try:
                await self.tiers[i].start_load_kv(ctx)
            except Exception as exc:
                self._failed("start_load_kv", i, exc)
                self._loads_failed(i)
                self._active = tuple(t for t in self._active if t != i)
                with self._lock:
                    self._save_broken = True

    def wait_for_layer_load(self, layer: int) -> None:
        """Wait for ``layer`` in every bound tier. Forward thread; thread-safe."""
        for i in self._active:
            try:
                self.tiers[i].wait_for_layer_load(layer)
            except Exception as exc:
                self._failed("wait_for_layer_load", i, exc)
                self._loads_failed(i)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Save ``layer`` to every bound tier (the loaded blocks of every tier are in
        ``kv_layer`` by now, which is how promotion works). Forward thread."""
        for i in self._active:
            try:
                self.tiers[i].save_kv_layer(layer, kv_layer, ctx)
            except Exception as exc:
                self._failed("save_kv_layer", i, exc)
                with self._lock:
                    self._save_broken = True

    async def wait_for_save(self) -> frozenset[str]:
        """Wait for every tier's saves; the union of their failed requests, or every
        request of the step when a tier's save raised."""
        failed: set[str] = set()
        for i in self._active:
            try:
                failed |= await self.tiers[i].wait_for_save()
            except Exception as exc:
                self._failed("wait_for_save", i, exc)
                with self._lock:
                    self._save_broken = True
        with self._lock:
            broken = self._save_broken
        if broken and self._ctx is not None:
            failed |= {r.req_id for r in self._ctx.scheduler_output.requests}
        return frozenset(failed)

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """The union of the active tiers' finished transfers (a tier that sat the step
        out reports its async transfers in a later step)."""
        sending: set[str] = set()
        recving: set[str] = set()
        for i in self._active:
            tier = self.tiers[i]
            try:
                done = await tier.get_finished(finished_req_ids)
            except Exception as exc:
                self._failed("get_finished", i, exc)
                continue
            sending |= done.sending
            recving |= done.recving
        return WorkerFinished(frozenset(sending), frozenset(recving))

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """The active tiers' load errors plus every block of a tier that failed."""
        errors: set[int] = set()
        for i in self._active:
            tier = self.tiers[i]
            try:
                errors |= tier.get_block_ids_with_load_errors()
            except Exception as exc:
                self._failed("get_block_ids_with_load_errors", i, exc)
        with self._lock:
            return frozenset(errors | self._load_errors)

    def get_load_failures(self) -> LoadFailures | None:
        """The active tiers' causes, merged (a failed tier's blocks stay ``unknown``)."""
        merged: LoadFailures | None = None
        for i in self._active:
            try:
                failures = self.tiers[i].get_load_failures()
            except Exception as exc:
                self._failed("get_load_failures", i, exc)
                continue
            if failures is not None:
                merged = failures if merged is None else merged.merge(failures)
        return merged

    def get_kv_stats(self) -> KVStats:
        """The active tiers' stats, summed (a tier whose query raises counts nothing)."""
        total = KVStats()
        for i in self._active:
            tier = self.tiers[i]
            try:
                total += KVStats._make(tier.get_kv_stats())
            except Exception as exc:
                self._failed("get_kv_stats", i, exc)
        return total

    def clear_connector_metadata(self) -> None:
        """Clear every tier, each in its own ``try``. Never blocks, never raises."""
        super().clear_connector_metadata()
        self._active, self._ctx = (), None
        for i, tier in enumerate(self.tiers):
            try:
                tier.clear_connector_metadata()
            except Exception as exc:
                self._failed("clear_connector_metadata", i, exc)

    async def aclose(self) -> None:
        """Close every tier (shielded), then re-raise the first error. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[Exception] = []
        with anyio.CancelScope(shield=True):
            for i, tier in enumerate(self.tiers):
                try:
                    await tier.aclose()
                except Exception as exc:
                    self._failed("aclose", i, exc)
                    errors.append(exc)
        if errors:
            raise errors[0]
