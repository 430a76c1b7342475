"""The nouns of the connector API: roles, the model fingerprint, the construction
context, step metadata and the named results of the halves' calls (:mod:`connectors.base`
is the map of the API)."""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import msgspec

if TYPE_CHECKING:
    import torch

    from pipeline.artifacts import SchedulerOutput

__all__ = [
    "ConnectorContext",
    "ForwardContext",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
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
        layer_pattern: Which layers attend through a sliding window, and its length
            (``ModelConfig.layer_pattern``, e.g. ``"SSSSSF:512"``); ``""`` when none
            does. A block's KV depends on it, so a block computed under one pattern
            never loads into a model of another.
    """

    architecture: str
    weights_id: str
    dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    kv_heads: int = 0
    layer_pattern: str = ""

    def key(self) -> str:
        """A short stable string for storage keys (hex digest of the fields).

        ``kv_heads=0`` (unknown) and ``layer_pattern=""`` (no sliding layer) are left
        out, so such a key is what it was before the field existed.
        """
        import hashlib

        fields = attrs.astuple(self)
        if not self.layer_pattern:
            fields = fields[:-1] if self.kv_heads else fields[:-2]
        raw = msgspec.msgpack.encode(fields)
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
        engine_id: The engine's id (``EngineConfig.engine_id``), the same for both
            halves and every rank of one engine, and unique per engine: a started
            engine always has one.
    """

    role: KVConnectorRole
    options: dict[str, Any] = attrs.field(factory=dict)
    block_size: int = 16
    fingerprint: ModelFingerprint | None = None
    rank: int = 0
    world_size: int = 1
    hash_seed: int = 0
    engine_id: str = ""


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
