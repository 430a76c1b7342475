"""The KV connector API, split by role, with vLLM's ``KVConnectorBase_V1`` method names.

Where each method runs::

    scheduler process (engine)                    each worker rank
    ─────────────────────────                     ─────────────────────────────────────
    schedule():                                   one step (worker graph):
      get_num_new_matched_tokens  (per waiting      bind_connector_metadata    (bind)
                                   request)         start_load_kv              (load)
      update_state_after_alloc    (after alloc)     wait_for_layer_load  ┐ per layer,
      build_connector_meta        (once/step)       save_kv_layer        ┘ forward thread
    update():                                       wait_for_save              (save)
      update_connector_output     (once/step)       get_finished               (finished)
      request_finished            (per finish)      get_block_ids_with_load_errors
    has_pending_work              (engine loop)     clear_connector_metadata   (finalizer)

A connector is registered under a name with one class per role
(:func:`connectors.registry.register_connector`). Both classes are constructed with a
:class:`ConnectorContext`. Worker-side calls are checked by the lifecycle guard
(:mod:`connectors.lifecycle`); the step-level calls that may wait are ``async``, the two
per-layer hooks are synchronous and must be thread-safe: they run inside the forward
pass, off the event loop.
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
    """Scheduler half: decides what to load and save. Runs on the event loop; no call
    may block on I/O for long (use ``load_async`` for slow lookups)."""

    role: ClassVar[KVConnectorRole] = KVConnectorRole.SCHEDULER

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """Tokens beyond ``num_computed_tokens`` (local prefix hit) the connector can load.

        Called once per scheduling attempt of a waiting request, before allocation.
        Must not mutate the request. Only whole blocks may be claimed.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; remember which to load into.

        Called once per successful allocation of a waiting request, even when
        ``num_external_tokens`` is 0.
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's metadata and reset per-step scheduler state.

        Called once per step, including steps with nothing scheduled.
        """

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """A request finished; return whether its blocks must stay until KV is sent."""
        return RequestFinishedResult()

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """Merged worker results of a step (finished transfers, load/save errors)."""

    def has_pending_work(self) -> bool:
        """Whether transfers are still in flight; the engine keeps stepping until not."""
        return False


class KVConnectorWorker(abc.ABC):  # noqa: B024
    """Worker half: moves KV between the paged cache and the store, one step at a time.

    Every call goes through the lifecycle guard: per step, ``bind_connector_metadata``
    → ``start_load_kv`` → per-layer hooks → ``wait_for_save`` → ``get_finished`` →
    ``clear_connector_metadata``; nothing after clear.
    """

    role: ClassVar[KVConnectorRole] = KVConnectorRole.WORKER

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Called once at start with the paged cache, one tensor per layer."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Bind this step's metadata. Synchronous, never blocks."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata. Synchronous, cannot fail; runs on every step."""
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata | None:
        """The metadata bound for the current step, ``None`` between steps."""
        return self._metadata

    async def start_load_kv(self, ctx: ForwardContext) -> None:  # noqa: B027
        """Start loading this step's KV; may return before it arrives. Cancellation-safe."""

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027
        """Block until layer ``layer``'s KV is in the paged cache. Forward thread."""

    def save_kv_layer(  # noqa: B027
        self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext
    ) -> None:
        """Start saving layer ``layer``'s KV (may be async). Forward thread."""

    async def wait_for_save(self) -> frozenset[str]:
        """Wait until this step's saves are durable; return request ids whose save failed."""
        return frozenset()

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """Requests whose async send/receive finished since the previous call."""
        return WorkerFinished()

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks whose load failed this step (reported once each)."""
        return frozenset()

    def get_kv_stats(self) -> tuple[int, int, int, int]:
        """(loaded_tokens, loaded_bytes, saved_tokens, saved_bytes) of this step."""
        return (0, 0, 0, 0)

    async def aclose(self) -> None:  # noqa: B027
        """Release resources; idempotent; always releases even if it raises."""
