"""The KV connector API, split by role, with vLLM's ``KVConnectorBase_V1`` method names.

Which method runs where (stage of the engine or worker graph, process, thread)::

    scheduler half: engine process, event loop     worker half: each rank, per step
    ──────────────────────────────────────────     ──────────────────────────────────────
    schedule stage:                                bind stage (event loop):
      get_num_new_matched_tokens  per waiting        begin_step                once
                                  request, per try   bind_connector_metadata   once
                                                   load stage (event loop):
      update_state_after_alloc    per allocation     start_load_kv             once, async
      build_connector_meta        once per step    forward stage (compute thread):
    update stage:                                    wait_for_layer_load  ┐ per layer,
      update_connector_output     once per step      save_kv_layer        ┘ in order
      request_finished            per finished     save stage (event loop):
                                  request            wait_for_save             once, async
    engine loop, between steps:                    finished stage (event loop):
      has_pending_work            per decision       get_finished              once, async
                                                     get_block_ids_with_load_errors, get_kv_stats
                                                   clear finalizer (always, event loop):
                                                     clear_connector_metadata  once
                                                   worker start / shutdown:
                                                     register_kv_caches, aclose

A connector is registered under a name with one class per role
(:func:`connectors.registry.register_connector`); both are constructed with a
:class:`ConnectorContext`. There is one scheduler half per engine and one worker half
per rank (in the engine process for in-process ranks, else in the rank's worker
process). Each method's docstring is its contract: who calls it and when, how often, on
which rank and thread, whether it may block or is ``async``, whether it is
cancellation-safe, what it returns and what it must not mutate.

Worker-side calls are checked by the lifecycle guard (:mod:`connectors.lifecycle`).
The step-level calls that may wait are ``async``; the two per-layer hooks are
synchronous and must be thread-safe: they run inside the forward pass, on the rank's
compute thread, off the event loop. Scheduler-side calls are synchronous and run on the
engine's event loop, so none may block for long.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import attrs
import msgspec

if TYPE_CHECKING:
    import torch

    from pipeline.artifacts import SchedulerOutput
    from pipeline.request import Request

__all__ = [
    "ConnectorContext",
    "ForwardContext",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "MatchResult",
    "ModelFingerprint",
    "RequestFinishedResult",
    "WorkerFinished",
]


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@attrs.frozen(kw_only=True)
class ModelFingerprint:
    """Identity of the model a KV block was computed by; part of every storage key.

    Attributes:
        architecture: The HF architecture name.
        weights_id: Identity of the whole checkpoint (the same on every rank).
        dtype: The KV dtype, e.g. ``"float32"``.
        block_size: Tokens per KV block.
        tp_rank: The worker's rank.
        tp_size: Number of worker ranks.
        kv_heads: KV heads this rank's cache holds; 0 when unknown. A tensor-parallel
            shard holds a slice of the heads while an in-process rank holds them all, so
            their keys differ and KV is never loaded into a layout it was not made by.
    """

    architecture: str
    weights_id: str
    dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    kv_heads: int = 0

    def key(self) -> str:
        """A short stable string for storage keys (hex digest of the fields).

        ``kv_heads=0`` (unknown) is left out, so such a key is what it was before the
        field existed.
        """
        import hashlib

        fields = attrs.astuple(self)
        raw = msgspec.msgpack.encode(fields if self.kv_heads else fields[:-1])
        return hashlib.sha256(raw).hexdigest()[:32]


@attrs.frozen(kw_only=True)
class ConnectorContext:
    """What a connector is built with (both roles).

    Attributes:
        role: Which half is being built.
        options: ``EngineConfig.connector_options``.
        block_size: Tokens per KV block.
        fingerprint: The model's fingerprint (``tp_rank`` is the worker's rank).
        rank: Worker rank (0 on the scheduler side).
        world_size: Number of worker ranks.
        hash_seed: Root seed of the chained block hashes.
    """

    role: KVConnectorRole
    options: dict[str, Any] = attrs.field(factory=dict)
    block_size: int = 16
    fingerprint: ModelFingerprint | None = None
    rank: int = 0
    world_size: int = 1
    hash_seed: int = 0


class KVConnectorMetadata(abc.ABC):  # noqa: B024
    """Per-step instructions from the scheduler half to the worker half.

    Abstract: each connector defines its own. Between steps the bound metadata is
    ``None``, never an empty placeholder. Metadata crosses process boundaries, so it
    serialises to bytes without pickle: the default implementation encodes an attrs or
    msgspec subclass with msgpack.
    """

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVConnectorMetadata:
        result: KVConnectorMetadata = msgspec.msgpack.decode(data, type=cls)
        return result


class MatchResult(NamedTuple):
    """Answer of ``get_num_new_matched_tokens``.

    ``num_tokens`` is ``None`` when the connector cannot tell yet (ask again next step);
    ``load_async`` parks the request in ``WAITING_FOR_REMOTE_KVS`` until
    ``finished_recving`` names it.
    """

    num_tokens: int | None
    load_async: bool = False


class RequestFinishedResult(NamedTuple):
    """Answer of ``request_finished``: delay freeing the blocks while KV is sent."""

    delay_free: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class WorkerFinished(NamedTuple):
    """Answer of ``get_finished``: requests whose async send / receive completed."""

    sending: frozenset[str] = frozenset()
    recving: frozenset[str] = frozenset()


@attrs.frozen(kw_only=True)
class KVConnectorOutput:
    """The merged worker-side connector results of one step, for the scheduler half.

    ``expired_sending`` / ``expired_recving``: transfers that some rank never reported
    within the fan-in lease (``EngineConfig.transfer_lease_s``); the engine freed the
    blocks (send) or failed the request (load), so the connector can drop them too.
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    expired_sending: frozenset[str] = frozenset()
    expired_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_save_req_ids: frozenset[str] = frozenset()


@attrs.frozen(kw_only=True)
class ForwardContext:
    """What the worker-side hooks see of the forward pass of one step.

    Attributes:
        step_id: The step.
        rank: This worker's rank.
        kv_caches: One tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        scheduler_output: The step's :class:`~pipeline.artifacts.SchedulerOutput`.
    """

    step_id: int
    rank: int
    kv_caches: Sequence[torch.Tensor]
    scheduler_output: SchedulerOutput


class KVConnectorScheduler(abc.ABC):
    """Scheduler half: decides what each step loads and saves, and when blocks are freed.

    One instance per engine, built by :func:`connectors.registry.create_connector` with
    the engine's :class:`ConnectorContext` (``rank`` 0). Every call comes from the
    engine process, on the thread of its event loop, one at a time (the scheduler half
    need not be thread-safe) and never concurrently with a step's ``schedule`` or
    ``update`` stage. No call is ``async`` and none may block on I/O for long: a slow
    lookup answers ``MatchResult(None)`` (ask again next step) or loads with
    ``load_async``. A call that raises is contained: the method's ``Raises`` section says
    what fails (a request, a step's metadata, a log line); the engine keeps serving.
    """

    role: ClassVar[KVConnectorRole] = KVConnectorRole.SCHEDULER

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """Tokens beyond ``num_computed_tokens`` (the local prefix hit) the connector can load.

        Called by the scheduler in the ``schedule`` stage of the engine graph, once per
        scheduling attempt of a waiting request, before its blocks are allocated: a
        request that stays waiting (no room, or ``num_tokens`` was ``None``) is asked
        again on a later step. Engine process, event loop; synchronous, must not block
        (no await, so cancellation never lands inside it). A request whose async load
        finished is not asked again.

        Args:
            request: The waiting request; read-only, must not be mutated.
            num_computed_tokens: Tokens the local prefix cache already holds (whole
                blocks).

        Returns:
            ``MatchResult(num_tokens, load_async)``: ``num_tokens`` extra tokens the
            connector can load (whole blocks only; the scheduler clamps a synchronous
            load to leave the last prompt token to compute), or ``None`` when it cannot
            tell yet. ``load_async=True`` parks the request in
            ``WAITING_FOR_REMOTE_KVS`` until a rank's ``get_finished`` names it in
            ``recving``.

        Raises:
            Exception: Any exception fails this request alone (finish reason
                ``"error"``); the other requests are scheduled.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; remember which to load into.

        Called by the scheduler in the ``schedule`` stage right after a successful
        allocation for a waiting request, once per allocation, even when
        ``num_external_tokens`` is 0 (a request resumed after its async load finished is
        allocated again, with 0). Engine process, event loop; synchronous, must not
        block; cancellation cannot land inside it.

        Args:
            request: The request; read-only, must not be mutated.
            block_ids: Every block the request now holds, in order; read-only (the
                scheduler owns the block table).
            num_external_tokens: Tokens this connector will load into those blocks (the
                clamped answer of :meth:`get_num_new_matched_tokens`).

        Raises:
            Exception: Any exception fails this request alone (its blocks are freed,
                :meth:`request_finished` is called).
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's metadata for the worker halves and reset per-step state.

        Called by the scheduler at the end of the ``schedule`` stage, exactly once per
        step, including steps with nothing scheduled, after every
        :meth:`update_state_after_alloc` of the step. Engine process, event loop;
        synchronous, must not block; cancellation cannot land inside it.

        Args:
            scheduler_output: The step as planned; read-only, must not be mutated.

        Returns:
            The step's metadata. The same object goes to every in-process rank and its
            :meth:`~KVConnectorMetadata.to_bytes` to every worker process: it must not
            be mutated after it is returned, by either half.

        Raises:
            Exception: The step's requests fail (their outputs come with the next
                update) and the step runs empty, without metadata.
        """

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """A request finished; say whether its blocks must stay until its KV is sent.

        Called once per request when it leaves the scheduler, whatever the reason: a
        stop or length limit in the ``update`` stage, an abort, or a failure. Its blocks
        are still allocated during the call. Engine process, event loop; synchronous,
        must not block; cancellation cannot land inside it.

        Args:
            request: The finished request; read-only, must not be mutated.
            block_ids: The blocks it holds; read-only.

        Returns:
            ``RequestFinishedResult(delay_free, kv_transfer_params)``: with
            ``delay_free`` the blocks stay allocated until every rank reports the
            request in ``sending`` (or the transfer lease expires and
            :meth:`update_connector_output` lists it in ``expired_sending``);
            ``kv_transfer_params`` travel with the request's final output. The default
            frees at once and returns no params.

        Raises:
            Exception: Logged; the blocks are freed at once.
        """
        return RequestFinishedResult()

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """Receive the worker results of a step, merged over every rank.

        Called by the scheduler in the ``update`` stage, once per step that reached
        fan-in, after the step's tokens and finished transfers were applied. Engine
        process, event loop; synchronous, must not block; cancellation cannot land
        inside it. The default does nothing.

        Args:
            output: Transfers every rank finished, transfers expired under the fan-in
                lease, blocks that failed to load, requests whose save failed;
                immutable.

        Raises:
            Exception: Logged; the step's outputs are kept.
        """

    def has_pending_work(self) -> bool:
        """Whether transfers are still in flight; the engine keeps stepping until not.

        Called by the engine loop between steps, whenever it decides whether another
        step would make progress (at least once per step): must be cheap. Engine
        process, event loop; synchronous, must not block; a query, it should not change
        state.

        Returns:
            ``True`` while the connector waits for work that only more steps complete
            (delayed frees, async loads or saves); the default is ``False``.

        Raises:
            Exception: Logged and read as ``False`` (drained).
        """
        return False


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
            Exception: The step fails on this rank. A save that fails later is no
                exception: report it from :meth:`wait_for_save`.
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
            Exception: The step fails on this rank.
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
            Exception: The step fails on this rank.
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

    def get_kv_stats(self) -> tuple[int, int, int, int]:
        """``(loaded_tokens, loaded_bytes, saved_tokens, saved_bytes)`` of this step.

        Called by the ``finished`` stage once per step on every rank, after
        :meth:`get_finished`. Rank's event loop; synchronous, must not block; a query
        that does not advance the lifecycle. Zeros by default.
        """
        return (0, 0, 0, 0)

    async def aclose(self) -> None:  # noqa: B027
        """Release every resource (threads, streams, connections, pinned memory).

        Called once per worker when the engine shuts down, after its last step's clear,
        on every rank (each closed even if another fails). Rank's event loop; ``async``,
        may wait. Idempotent: a second call is a no-op. Always releases, even if it
        raises or is cancelled (as trio's ``aclose``); nothing may be called after it.
        """
