"""The worker half of a connector (:mod:`connectors.base` is the map of the API)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from pipeline.artifacts import LoadFailures


from connectors.types import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorRole,
    WorkerFinished,
)
from pipeline.artifacts import KVStats

__all__ = [
    "KVConnectorWorker",
]


class KVConnectorWorker(abc.ABC):  # noqa: B024
    """Worker half: moves KV between this rank's paged cache and the store, per step.

    One instance per rank, built by :func:`connectors.registry.create_connector` with
    the rank's :class:`ConnectorContext` and wrapped in the lifecycle guard
    (:func:`connectors.lifecycle.make_worker`). In-process ranks share the engine's
    event loop; a worker process (multiproc, Ray) runs one rank on its own loop. Per
    step, on each rank, in this order (the guard refuses any other)::

        begin_step → bind_connector_metadata → start_load_kv
            → (wait_for_layer_load | save_kv_layer)* → wait_for_save → get_finished
            → clear_connector_metadata

    The step-level calls run on the rank's event loop; the ``async`` ones may wait and
    are cancelled when the step is (a fan-in deadline, another rank's failure, an engine
    shutdown), so each must leave the connector consistent at any await. The two
    per-layer hooks run on the rank's compute thread, inside the forward pass, while
    the event loop stays free: they must be thread-safe against the step-level calls.
    ``clear_connector_metadata`` runs on every step, whatever happened before it.
    A step that binds no metadata (``None``) makes none of the calls between bind and
    clear.
    """

    role: ClassVar[KVConnectorRole] = KVConnectorRole.WORKER

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    def begin_step(self, step_id: int) -> None:  # noqa: B027
        """Open step ``step_id`` on this rank.

        Called by the ``bind`` stage, first in every step on every rank, whether or not
        the step carries metadata, before :meth:`bind_connector_metadata`. Rank's event
        loop; synchronous, never blocks; cancellation cannot land inside it. The default
        does nothing; the lifecycle guard (:class:`connectors.lifecycle.GuardedWorker`)
        checks here that the previous step was cleared.

        Raises:
            Exception: The step fails on this rank; clear still runs.
        """

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Receive this rank's paged KV cache, before the first step.

        Called once per worker when the rank is built, outside any step. May allocate
        (pinned buffers, streams, connections) and block briefly; synchronous, so
        cancellation cannot land inside it. The default does nothing.

        Args:
            kv_caches: One tensor per layer, ``[2, num_blocks, block_size, kv_heads,
                head_dim]``, owned by the runner for the worker's lifetime: keep
                references, never resize, replace or free them.

        Raises:
            Exception: The rank fails to start.
        """

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Bind this step's metadata.

        Called by the ``bind`` stage, right after :meth:`begin_step`, once per step on
        every rank, only when the step carries metadata. Rank's event loop; synchronous, never
        blocks; cancellation cannot land inside it.

        Args:
            metadata: What :meth:`KVConnectorScheduler.build_connector_meta` built (or
                its copy decoded from bytes in a worker process); in-process ranks share
                the object, so it must not be mutated.

        Raises:
            Exception: The step fails on this rank (its requests end with ``"error"``);
                clear still runs.
        """
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata and per-step state.

        Called by the mandatory ``clear`` finalizer, last in the step, exactly once per
        step on every rank, whether the step succeeded, failed, was cancelled or bound
        nothing; nothing of the step follows it. Rank's event loop; synchronous, must
        not block or await (it runs inside the innermost ``finally``), so it is
        cancellation-safe by construction. Never skipped.

        Raises:
            Exception: Reported as a ``FinalizerError`` of the step; the metadata must
                be dropped anyway (the default cannot fail).
        """
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata | None:
        """The metadata bound for the current step, ``None`` between steps; read-only."""
        return self._metadata

    async def start_load_kv(self, ctx: ForwardContext) -> None:  # noqa: B027
        """Start loading this step's KV into the paged cache; may return before it lands.

        Called by the ``load`` stage once per step on every rank, after bind and before
        the forward pass. Rank's event loop; ``async``: it may await to issue the loads
        but should return as soon as they are started (the forward pass waits per layer
        in :meth:`wait_for_layer_load`). Cancellation-safe: a step cancelled here still
        clears, and loads already issued must be waited for or abandoned in
        :meth:`clear_connector_metadata` without writing into blocks afterwards.

        Args:
            ctx: The step's forward context; the cache tensors are written into, the
                rest (``scheduler_output`` is shared by in-process ranks) is read-only.

        Raises:
            Exception: The step fails on this rank. A block that cannot be loaded is no
                exception: report it in :meth:`get_block_ids_with_load_errors`.
        """

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027
        """Block until layer ``layer``'s KV for this step is in the paged cache.

        Called by the forward pass before layer ``layer``'s attention, once per layer
        per step (layers in order), on the rank's compute thread, never on the event
        loop. May block (that is its purpose); cannot be cancelled: bound its wait, and
        report a load that does not arrive as a load error instead of blocking forever.
        Must be thread-safe against the step-level calls.

        Raises:
            Exception: The step fails on this rank.
        """

    def save_kv_layer(  # noqa: B027
        self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext
    ) -> None:
        """Start saving layer ``layer``'s KV of this step (may copy asynchronously).

        Called by the forward pass after layer ``layer``'s attention, once per layer per
        step (layers in order), on the rank's compute thread, never on the event loop.
        Should not block for long (issue the copy, return); cannot be cancelled. Must
        be thread-safe against the step-level calls.

        Args:
            layer: The layer index.
            kv_layer: That layer's cache tensor; read it (it holds this step's K/V until
                the next step's forward pass), never write into it.
            ctx: The step's forward context; read-only.

        Raises:
            Exception: A save-side failure, never a failed step: the step's requests
                keep their tokens, every request of the step counts as a failed save
                on this rank (its blocks are neither reported stored nor announced),
                the raise is counted (``kvstep_kv_save_failures_total``, cause
                ``save_kv_layer``, or ``timeout`` for a ``TimeoutError``), and no later
                layer of the step is offered for saving: do not make the step's
                partly saved blocks durable. A save that fails later is best reported
                from :meth:`wait_for_save` instead.
        """

    async def wait_for_save(self) -> frozenset[str]:
        """Wait until this step's saves are durable (or have failed).

        Called by the ``save`` stage once per step on every rank, after the forward pass
        issued its :meth:`save_kv_layer` calls and before :meth:`get_finished`. Rank's
        event loop; ``async``, may wait for I/O. Cancellation-safe: on cancellation the
        step fails and clear runs; saves still in flight must not be reported as
        durable later.

        Returns:
            The ids of requests whose save failed this step (their blocks are released
            and the engine keeps serving); empty by default.

        Raises:
            Exception: A save-side failure, never a failed step: every request of the
                step counts as a failed save on this rank (tokens kept, blocks not
                reported stored nor announced), counted with cause ``wait_for_save``
                (``timeout`` for a ``TimeoutError``); :meth:`get_finished` and the
                clear still follow.
        """
        return frozenset()

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """Requests whose async send or receive finished since the previous call.

        Called by the ``finished`` stage once per step on every rank, after
        :meth:`wait_for_save`. Rank's event loop; ``async``, should not wait long (it
        polls). Cancellation-safe: a completion not yet returned must be returned by a
        later call, never lost.

        Args:
            finished_req_ids: Requests the scheduler finished this step (their
                per-request state may be dropped); read-only.

        Returns:
            ``WorkerFinished(sending, recving)``, each id once per rank: fan-in releases
            it to the scheduler only when every rank has reported it.

        Raises:
            Exception: Taken as a save-side failure, never a failed step: nothing is
                reported finished by this rank this step, every request of the step
                counts as a failed save on this rank, counted with cause
                ``get_finished`` (``timeout`` for a ``TimeoutError``). Completions not
                returned must come in a later call (as under cancellation), so a
                request parked for an async load stays parked until then; load errors
                are still asked for (:meth:`get_block_ids_with_load_errors`).
        """
        return WorkerFinished()

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks whose load failed this step, each reported once.

        Called by the ``finished`` stage once per step on every rank, after
        :meth:`get_finished`. Rank's event loop; synchronous, must not block; a query
        that does not advance the lifecycle.

        Returns:
            Block ids of the paged cache; the scheduler recomputes from the last valid
            block (or fails the request, by policy). Empty by default.
        """
        return frozenset()

    def get_load_failures(self) -> LoadFailures | None:
        """Why the blocks of this step's :meth:`get_block_ids_with_load_errors` failed.

        Called by the ``finished`` stage once per step on every rank, right after
        :meth:`get_block_ids_with_load_errors`. Rank's event loop; synchronous, must not
        block; a query that does not advance the lifecycle. The engine counts the
        failures by cause (``kvstep_kv_load_failures_total{connector,cause}``) and logs
        the first of each cause; a block named under no cause counts as ``unknown``.

        Returns:
            A :class:`~pipeline.artifacts.LoadFailures` naming the cause of the blocks
            this step reported (each block under one cause), or ``None`` (the default):
            the connector cannot tell, every block is ``unknown``.
        """
        return None

    def get_kv_stats(self) -> KVStats:
        """This step's connector traffic on this rank, as a :class:`~pipeline.artifacts.KVStats`
        (``loaded_tokens``, ``loaded_bytes``, ``saved_tokens``, ``saved_bytes``).

        Called by the ``finished`` stage once per step on every rank, after
        :meth:`get_finished`. Rank's event loop; synchronous, must not block; a query
        that does not advance the lifecycle. Zeros by default. (A connector that still
        returns the plain 4-tuple in that order keeps working: the stage names it.)
        """
        return KVStats()

    async def aclose(self) -> None:  # noqa: B027
        """Release every resource (threads, streams, connections, pinned memory).

        Called once per worker when the engine shuts down, after its last step's clear,
        on every rank (each closed even if another fails). Rank's event loop; ``async``,
        may wait. Idempotent: a second call is a no-op. Always releases, even if it
        raises or is cancelled (as trio's ``aclose``); nothing may be called after it.
        """
