"""The paged KV cache: one tensor per layer, fixed-size blocks addressed by slot.

Layout of each layer's tensor: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). Token ``offset`` of block ``block_id`` lives at slot
``block_id * block_size + offset`` of the flattened ``[num_blocks * block_size, ...]``
view, which is what :attr:`AttentionMetadata.slot_mapping` addresses.
"""

from __future__ import annotations

import math

import torch

from pipeline.errors import InvalidConfigError
from stages.forward.config import ModelConfig

__all__ = [
    "allocate_kv_caches",
    "default_num_blocks",
    "kv_cache_block_bytes",
]


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * elem
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
) -> list[torch.Tensor]:
    """Zero-filled caches, one ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer.

    Zeros (not ``empty``) so that padded reads of never-written slots stay finite.
    """
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
