"""The offload connector's options, validated once from ``EngineConfig.connector_options``.

The tier's size is counted in **slots** (one slot holds one KV block of every layer),
because the scheduler half decides every slot and cannot see the model: ``num_blocks``
says it directly. ``capacity_bytes`` is accepted together with ``block_bytes`` (the KV
bytes of one block over all layers, e.g. from
:func:`stages.model.kv_cache.kv_cache_block_bytes`); the slot count is then
``capacity_bytes // block_bytes``, and the worker half checks at
``register_kv_caches`` that ``block_bytes`` matches its paged cache, so the two halves
can never disagree about the size of the tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from connectors.options import (
    flag,
    option,
    option_name,
    option_names,
    optional,
    options_where,
    parse_options,
    positive_int,
    positive_number,
)
from pipeline.errors import InvalidConfigError

__all__ = ["OFFLOAD_OPTIONS", "OffloadOptions"]

_EXACTLY_ONE = (
    "offload needs exactly one of num_blocks (slots) or capacity_bytes "
    "(with block_bytes, the KV bytes of one block over all layers)"
)


def _slots(options: OffloadOptions) -> int:
    """``num_blocks`` when it is not given: ``capacity_bytes // block_bytes``."""
    capacity, block_bytes = options.capacity_bytes, options.block_bytes
    if capacity is None:
        raise InvalidConfigError(option_name("num_blocks"), None, _EXACTLY_ONE)
    if block_bytes is None:
        raise InvalidConfigError(
            option_name("block_bytes"),
            None,
            "capacity_bytes needs block_bytes (the KV bytes of one block over all "
            "layers, e.g. stages.model.kv_cache.kv_cache_block_bytes(...))",
        )
    if capacity // block_bytes < 1:
        raise InvalidConfigError(
            option_name("capacity_bytes"),
            capacity,
            f"must hold at least one block of {block_bytes} bytes",
        )
    return capacity // block_bytes


@attrs.frozen(kw_only=True)
class OffloadOptions:
    """What the offload connector was configured with.

    Attributes:
        capacity_bytes: The tier's size in bytes, when it was given that way (with
            ``block_bytes``) instead of ``num_blocks``; else ``None``.
        block_bytes: The per-block KV size the slot count was derived from, or ``None``
            when ``num_blocks`` was given directly (without it).
        num_blocks: Slots in the host-memory tier (the same on every rank): as given, or
            ``capacity_bytes // block_bytes``.
        async_load: Loads complete across steps: matched requests are parked in
            ``WAITING_FOR_REMOTE_KVS`` until every rank reports them in
            ``get_finished(...).recving``. Default: loads overlap the step's forward
            pass layer by layer. Caveat: the scheduler allocates a parked request's
            blocks for the loaded tokens only, so when the paged cache is nearly full,
            resumed requests can wait on each other's blocks.
        verify_checksum: Keep a per-slot, per-layer checksum written at save time and
            verified on every load (one extra read of the loaded bytes). Off by default:
            the per-slot key check always runs and costs nothing per byte, while
            checksums took loads from ~75-86% to ~26-37% of memcpy bandwidth on CPU
            (``benchmarks/kv_reuse.py``).
        load_timeout_s: Longest ``wait_for_layer_load`` waits before it reports the
            step's loads as failed instead of hanging the forward pass.
    """

    capacity_bytes: int | None = option(optional(positive_int), default=None)
    block_bytes: int | None = option(optional(positive_int), default=None)
    num_blocks: int = option(positive_int, default=attrs.Factory(_slots, takes_self=True))
    async_load: bool = option(flag, default=False)
    verify_checksum: bool = option(flag, default=False)
    load_timeout_s: float = option(positive_number, default=60.0)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> OffloadOptions:
        """Validate ``options`` (``EngineConfig.connector_options``); once, when a half
        is built.

        Raises:
            InvalidConfigError: An unknown option, a bad value, neither or both of
                ``num_blocks`` / ``capacity_bytes``, ``capacity_bytes`` without
                ``block_bytes``, or a capacity smaller than one block.
        """
        parsed = parse_options(cls, options, connector="offload")
        if "num_blocks" in options and "capacity_bytes" in options:
            raise InvalidConfigError(options_where(), dict(options), _EXACTLY_ONE)
        return parsed


OFFLOAD_OPTIONS = option_names(OffloadOptions)
"""Every option the offload connector accepts."""
