"""The KV cache events and their wire encoding, readable by routers written for vLLM.

A replica publishes what its caches hold: :class:`BlockStored` when full blocks enter a
cache under their hashes, :class:`BlockRemoved` when hashes leave it, and
:class:`AllBlocksCleared` when a cache is emptied. The events of one engine step travel
together in a :class:`KVEventBatch`.

**Schema.** Field names, order and meaning are those of vLLM's
``vllm/distributed/kv_events.py`` in its tagged-array form: from the ``lora_name`` field
(vllm-project/vllm#27577) up to the switch to map encoding (vllm-project/vllm#42892).
Each struct is a msgspec ``array_like`` struct, so it encodes (msgpack) as a positional
array; the event structs are ``tag=True``, so each event array starts with its class name::

    KVEventBatch  = [ts, [event, ...], data_parallel_rank]
    BlockStored   = ["BlockStored", block_hashes, parent_block_hash, token_ids,
                     block_size, lora_id, medium, lora_name]
    BlockRemoved  = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

Differences from vLLM, all compatible with its decoders: ``BlockStored`` stops at
``lora_name`` (vLLM's later optional fields ``extra_keys``, ``group_idx`` and the
cache-spec fields default to ``None`` on decode; a decoder of the older seven-field schema
ignores the trailing ``lora_name``, as msgspec ignores extra trailing array items);
``BlockRemoved`` has no ``group_idx`` (optional in vLLM); kvstep has one KV cache group
and no data parallelism (``data_parallel_rank`` is ``0``, as vLLM's rank-0 publisher
sends). A device-tier ``BlockStored`` of a LoRA request's blocks names the adapter
(``lora_id``, ``lora_name``); its hashes cover the adapter's weights
(:meth:`pipeline.lora.LoRAAdapter.extra_keys`), so a router's
:func:`prompt_block_hashes` (no adapter) never matches them.

**Block hashes on the wire** (vLLM's ``ExternalBlockHash``, ``bytes | int``): by default
the low 64 bits of the 32-byte SHA-256 digest as an unsigned int, exactly as vLLM with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (its default) converts its digests
(:func:`external_block_hash`); with ``KVEventsConfig(hash_format="bytes")`` the whole
32-byte digest. The digests are those of :mod:`pipeline.block_hashes` (vLLM's
``sha256_cbor`` chain from the engine's ``hash_seed``); a router recomputes a prompt's
with :func:`prompt_block_hashes`. A replica's hash of block ``i`` is a pure function of
the prompt's token ids up to the end of that block, the ``block_size`` and the engine's
``hash_seed``; the device tier's hashes do not include the model fingerprint, so a router
compares hashes only among replicas that serve the same model with the same
``block_size`` and ``hash_seed``. This module does not import the scheduler (the proxy
imports it).

**Media.** Each event names the tier it is about, with vLLM's names: ``"GPU"``
(:data:`MEDIUM_GPU`) for the device tier on every device, as vLLM's block pool does on
every platform (so a CPU engine's device tier and its host-memory offload tier stay two
media), ``"CPU"`` (:data:`MEDIUM_CPU`) for the ``offload`` connector's tier, as
vLLM's CPU offloading connector, ``"DISK"`` (:data:`MEDIUM_DISK`) for ``shared_storage``
and ``"REDIS"`` (:data:`MEDIUM_REDIS`) for ``redis`` (vLLM has no agreed name for
these; see :class:`~connectors.store.events.StoreEvents` for what they report). A
tier publishes its own adds and evictions; a block may be held by several tiers at
once, so a router keeps one set per medium (:class:`~pipeline.kv_events.KVBlockIndex`).
The ``BlockStored`` events of the offload and store tiers carry hashes only
(``token_ids`` empty, ``parent_block_hash`` ``None``), as vLLM's offloading connector
sends them.

Unlike vLLM's pool, kvstep's keeps one block per hash (a second block computed for a
cached hash stays uncached), and the offload tier holds one slot per hash, so the events
describe each tier's set of held hashes exactly: a hash is stored once and removed once
per tier. ``AllBlocksCleared`` (sent by the device pool's ``reset_prefix_cache``, which
the engine never calls while serving) empties every medium of a router's index, as in
vLLM: the offload tier's hashes are then under-counted, never invented.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from pipeline.block_hashes import hash_request_tokens
from pipeline.checks import check_int
from pipeline.errors import InvalidRequestError

__all__ = [
    "HASH_FORMATS",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_REDIS",
    "AllBlocksCleared",
    "BlockStored",
    "BlockRemoved",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
    "prompt_block_digests",
    "prompt_block_hashes",
]

MEDIUM_GPU = "GPU"
"""The ``medium`` of the device tier, the block pool of the engine's own KV cache, on
every device (CPU engines included): vLLM's block pool sends ``MEDIUM_GPU`` on every
platform, and routers written for vLLM read it as the tier that needs no load."""
MEDIUM_CPU = "CPU"
"""The ``medium`` of the ``offload`` connector's host-memory tier, as vLLM's CPU
offloading connector names its tier (a block there is loaded before it is used)."""
MEDIUM_DISK = "DISK"
"""The ``medium`` of the ``shared_storage`` tier (a directory on a disk or a shared
filesystem; a block there is loaded before it is used)."""
MEDIUM_REDIS = "REDIS"
"""The ``medium`` of the ``redis`` tier (values in a Redis server; loaded before use)."""

ExternalBlockHash = bytes | int
"""A block hash as it appears in an event (vLLM's ``ExternalBlockHash``)."""

HASH_FORMATS = ("int", "bytes")
"""How hashes appear on the wire: ``"int"`` (low 64 bits, vLLM's default) or ``"bytes"``."""

_LOW_64 = (1 << 64) - 1


def external_block_hash(digest: bytes, hash_format: Literal["int", "bytes"] = "int") -> Any:
    """A block's hash as events carry it.

    Args:
        digest: The 32-byte chained SHA-256 digest of the block.
        hash_format: ``"int"``: the digest's low 64 bits as an unsigned int (the big-endian
            value of its last 8 bytes), as vLLM's ``maybe_convert_block_hash``;
            ``"bytes"``: the digest itself.
    """
    if hash_format == "bytes":
        return digest
    return int.from_bytes(digest, "big") & _LOW_64


def prompt_block_digests(
    token_ids: Sequence[int], block_size: int, *, hash_seed: int = 0
) -> list[bytes]:
    """The 32-byte chained digest of every full block of ``token_ids`` (a trailing
    partial block has none), equal to a replica's ``request.block_hashes``.

    Raises:
        InvalidRequestError: ``block_size`` is not a positive int, or ``hash_seed`` is
            not an int.
    """
    check_int("hash_seed", hash_seed, InvalidRequestError)
    return hash_request_tokens(token_ids, block_size, hash_seed=hash_seed)


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_seed: int = 0,
    hash_format: Literal["int", "bytes"] = "int",
) -> list[ExternalBlockHash]:
    """The hashes of ``token_ids``' full blocks as a replica's events carry them (the
    replica's ``KVEventsConfig.hash_format``): what a router looks up in its index."""
    return [
        external_block_hash(d, hash_format)
        for d in prompt_block_digests(token_ids, block_size, hash_seed=hash_seed)
    ]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step.

    Attributes:
        ts: When the batch was made (``time.time()``, seconds since the epoch).
        events: The step's events, in the order they happened.
        data_parallel_rank: The publishing engine's data-parallel rank (``0``).
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered a cache under their hashes.

    Attributes:
        block_hashes: The blocks' hashes: from the device tier a chain in prefix order
            (each block's parent is the one before it); from the offload tier, which
            keeps hashes only, the blocks whose saves were confirmed, in that order.
        parent_block_hash: The hash of the block before the first one (``None`` when the
            first block starts the prompt, and always from the offload tier).
        token_ids: The blocks' tokens, ``block_size`` per block, in order (empty from
            the offload tier, as from vLLM's offloading connector).
        block_size: Tokens per block.
        lora_id: The LoRA adapter's id whose request computed the blocks (device tier),
            or ``None``.
        medium: The cache tier that holds them (``"GPU"``: the device tier, ``"CPU"``:
            the offload tier).
        lora_name: That adapter's name, or ``None``.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Hashes left a cache (their blocks were evicted or must not be reused).

    Attributes:
        block_hashes: The hashes removed.
        medium: The cache tier they left.
    """

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every hash left the publishing engine's caches."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""Any one KV cache event."""


class KVEventBatch(EventBatch):
    """An :class:`EventBatch` of KV cache events (what a subscriber decodes)."""

    events: list[KVEvent]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch`` (the third frame of a published message)."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload.

    Raises:
        msgspec.DecodeError: ``payload`` is not a valid ``KVEventBatch`` (a
            ``msgspec.ValidationError`` when it is msgpack of the wrong shape).
    """
    return _DECODER.decode(payload)
