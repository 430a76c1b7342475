"""The paged KV cache: one tensor per layer, fixed-size blocks addressed by slot.

Layout of each layer's tensor: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). Token ``offset`` of block ``block_id`` lives at slot
``block_id * block_size + offset`` of the flattened ``[num_blocks * block_size, ...]``
view, which is what :attr:`AttentionMetadata.slot_mapping` addresses. A tensor-parallel
rank (``tp_size > 1``) holds only its own ``num_key_value_heads // tp_size`` heads.
"""

from __future__ import annotations

import math

import torch

from pipeline.errors import InvalidConfigError
from stages.model.config import ModelConfig
from stages.model.parallel import check_tp_divisible

__all__ = [
    "allocate_kv_caches",
    "default_num_blocks",
    "kv_cache_block_bytes",
    "local_kv_heads",
]


def local_kv_heads(config: ModelConfig, tp_size: int = 1) -> int:
    """KV heads one rank of a ``tp_size``-way tensor-parallel group holds.

    Raises:
        InvalidConfigError: ``tp_size`` does not divide the model's heads or MLP width.
    """
    if tp_size != 1:
        check_tp_divisible(config, tp_size)
    return max(1, config.num_key_value_heads // tp_size)  # one replicated head past kv


def kv_cache_block_bytes(
    config: ModelConfig, block_size: int, dtype: torch.dtype, *, tp_size: int = 1
) -> int:
    """Bytes one block takes across all layers (keys and values) on one rank.

    Raises:
        InvalidConfigError: ``tp_size`` does not divide the model's heads or MLP width.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    heads = local_kv_heads(config, tp_size)
    per_layer = 2 * block_size * heads * config.head_dim * elem
    return per_layer * config.num_hidden_layers


def default_num_blocks(
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    block_bytes: int,
    memory_cap_bytes: int,
) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped by memory.

    Raises:
        InvalidConfigError: The cap cannot hold even one ``max_model_len`` sequence
            (the error names ``kv_cache_memory_bytes`` and the minimum it needs).
    """
    per_seq = math.ceil(max_model_len / block_size)
    wanted = max_num_seqs * per_seq
    affordable = memory_cap_bytes // block_bytes
    if affordable < per_seq:
        raise InvalidConfigError(
            "kv_cache_memory_bytes",
            memory_cap_bytes,
            f"must hold at least one sequence of max_model_len={max_model_len} tokens: "
            f">= {per_seq * block_bytes} bytes ({per_seq} blocks of {block_bytes} bytes)",
        )
    return min(wanted, affordable)


def allocate_kv_caches(
    config: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
) -> list[torch.Tensor]:
    """Zero-filled caches, one ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer.

    ``kv_heads`` is this rank's share, ``num_key_value_heads // tp_size``. Zeros (not
    ``empty``) so that padded reads of never-written slots stay finite.

    Raises:
        InvalidConfigError: ``tp_size`` does not divide the model's heads or MLP width.
    """
    heads = local_kv_heads(config, tp_size)
    shape = (2, num_blocks, block_size, heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
