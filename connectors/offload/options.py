"""The offload connector's options, validated once from ``EngineConfig.connector_options``.

The tier's size is counted in **slots** (one slot holds one KV block of every layer),
because the scheduler half decides every slot and cannot see the model: ``num_blocks``
says it directly. ``capacity_bytes`` is accepted together with ``block_bytes`` (the KV
bytes of one block over all layers, e.g. from
:func:`stages.forward.kv_cache.kv_cache_block_bytes`); the slot count is then
``capacity_bytes // block_bytes``, and the worker half checks at
``register_kv_caches`` that ``block_bytes`` matches its paged cache, so the two halves
can never disagree about the size of the tier.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.checks import check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = ["OFFLOAD_OPTIONS", "OffloadOptions"]

OFFLOAD_OPTIONS = (
    "num_blocks",
    "capacity_bytes",
    "block_bytes",
    "async_load",
    "verify_checksum",
    "load_timeout_s",
)
"""Every option the offload connector accepts."""


def _positive_int(name: str, value: object) -> int:
    return check_int(f"connector_options[{name!r}]", value, InvalidConfigError, lo=1)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfigError(f"connector_options[{name!r}]", value, "must be true or false")
    return value


@attrs.frozen(kw_only=True)
class OffloadOptions:
    """What the offload connector was configured with.

    Attributes:
        num_blocks: Slots in the host-memory tier (the same on every rank).
        block_bytes: The per-block KV size the slot count was derived from, or ``None``
            when ``num_blocks`` was given directly.
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

    num_blocks: int
    block_bytes: int | None = None
    async_load: bool = False
    verify_checksum: bool = False
    load_timeout_s: float = 60.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> OffloadOptions:
        """Validate ``options`` (``EngineConfig.connector_options``).

        Raises:
            InvalidConfigError: An unknown option, a bad value, neither or both of
                ``num_blocks`` / ``capacity_bytes``, ``capacity_bytes`` without
                ``block_bytes``, or a capacity smaller than one block.
        """
        unknown = sorted(set(options) - set(OFFLOAD_OPTIONS))
        if unknown:
            raise InvalidConfigError(
                "connector_options", unknown[0], f"offload accepts {', '.join(OFFLOAD_OPTIONS)}"
            )
        has_blocks, has_bytes = "num_blocks" in options, "capacity_bytes" in options
        if has_blocks == has_bytes:
            raise InvalidConfigError(
                "connector_options",
                dict(options),
                "offload needs exactly one of num_blocks (slots) or capacity_bytes "
                "(with block_bytes, the KV bytes of one block over all layers)",
            )
        block_bytes: int | None = None
        if has_blocks:
            if "block_bytes" in options:
                block_bytes = _positive_int("block_bytes", options["block_bytes"])
            num_blocks = _positive_int("num_blocks", options["num_blocks"])
        else:
            capacity = _positive_int("capacity_bytes", options["capacity_bytes"])
            if "block_bytes" not in options:
                raise InvalidConfigError(
                    "connector_options['block_bytes']",
                    None,
                    "capacity_bytes needs block_bytes (the KV bytes of one block over all "
                    "layers, e.g. stages.forward.kv_cache.kv_cache_block_bytes(...))",
                )
            block_bytes = _positive_int("block_bytes", options["block_bytes"])
            num_blocks = capacity // block_bytes
            if num_blocks < 1:
                raise InvalidConfigError(
                    "connector_options['capacity_bytes']",
                    capacity,
                    f"must hold at least one block of {block_bytes} bytes",
                )
        timeout = options.get("load_timeout_s", 60.0)
        timeout = check_float(
            "connector_options['load_timeout_s']",
            timeout,
            InvalidConfigError,
            lo=0.0,
            hi=math.inf,
            lo_open=True,
            allow_inf=True,
        )
        return cls(
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            async_load=_flag("async_load", options.get("async_load", False)),
            verify_checksum=_flag("verify_checksum", options.get("verify_checksum", False)),
            load_timeout_s=timeout,
        )
