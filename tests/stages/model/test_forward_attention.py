"""Paged attention metadata, the KV cache layout and sizing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.errors import InvalidConfigError
from stages.model import (
    ModelConfig,
    allocate_kv_caches,
    build_attention_metadata,
    default_num_blocks,
    kv_cache_block_bytes,
    paged_attention,
)

CPU = torch.device("cpu")
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


class TestAttentionMetadata:
    def test_slots_positions_and_split(self) -> None:
        """Slots follow block_id * block_size + offset; decodes and prefills are split."""
        meta = build_attention_metadata(
            query_lens=[3, 1, 2],
            context_lens=[0, 5, 4],
            block_tables=[[7], [2, 9], [4, 1, 8]],
            block_size=4,
            device=CPU,
        )
        assert meta.positions.tolist() == [0, 1, 2, 5, 4, 5]
        assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 4, 5]
        assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
        assert meta.seq_lens.tolist() == [3, 6, 6]
        assert meta.decode is not None and meta.decode.token_rows.tolist() == [3]
        assert [(p.start, p.end, p.context_len) for p in meta.prefills] == [(0, 3, 0), (4, 6, 4)]
        assert meta.prefills[0].mask is None and meta.prefills[1].mask is not None

    def test_matches_dense_causal_attention(self) -> None:
        """Mixed decode/prefill paged attention equals dense causal attention per request."""
        gen = torch.Generator().manual_seed(0)
        bs, heads, kv_heads, hd = 4, 4, 2, 8
        cache = torch.zeros(2, 16, bs, kv_heads, hd)
        full = {
            n: (
                torch.randn(n, heads, hd, generator=gen),
                torch.randn(n, kv_heads, hd, generator=gen),
                torch.randn(n, kv_heads, hd, generator=gen),
            )
            for n in (6, 9, 3)
        }
        tables = {6: [3, 5], 9: [0, 11, 2], 3: [8]}
        ctx = {6: 5, 9: 6, 3: 0}  # request 6 decodes, 9 continues a prefill, 3 is new
        warm = [n for n in full if ctx[n]]
        pre = build_attention_metadata(
            query_lens=[ctx[n] for n in warm],
            context_lens=[0] * len(warm),
            block_tables=[tables[n] for n in warm],
            block_size=bs,
            device=CPU,
        )
        q, k, v = (torch.cat([full[n][i][: ctx[n]] for n in warm]) for i in range(3))
        paged_attention(q, k, v, cache, pre, hd**-0.5)
        meta = build_attention_metadata(
            query_lens=[len(full[n][0]) - ctx[n] for n in full],
            context_lens=list(ctx.values()),
            block_tables=list(tables.values()),
            block_size=bs,
            device=CPU,
        )
        q, k, v = (torch.cat([full[n][i][ctx[n] :] for n in full]) for i in range(3))
        out = paged_attention(q, k, v, cache, meta, hd**-0.5)
        rows = 0
        for n, (q, k, v) in full.items():
            ref = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.repeat_interleave(2, 1).transpose(0, 1),
                v.repeat_interleave(2, 1).transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)[ctx[n] :]
            got = out[rows : rows + len(ref)]
            rows += len(ref)
            assert torch.allclose(got, ref, atol=1e-5), n


class TestKVCache:
    def test_layout(self) -> None:
        """One zeroed [2, blocks, block_size, kv_heads, head_dim] tensor per layer."""
        caches = allocate_kv_caches(
            CONFIG, num_blocks=5, block_size=4, dtype=torch.float16, device=CPU
        )
        assert len(caches) == 2
        assert caches[0].shape == (2, 5, 4, 2, 8) and caches[0].dtype == torch.float16
        assert not caches[0].any()

    def test_block_bytes(self) -> None:
        """Bytes per block count K and V of every layer."""
        assert kv_cache_block_bytes(CONFIG, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 8 * 2

    def test_default_num_blocks(self) -> None:
        """Enough for max_num_seqs full sequences, capped by memory."""
        kw = dict(max_model_len=100, block_size=16, block_bytes=1000)
        assert default_num_blocks(max_num_seqs=3, memory_cap_bytes=10**9, **kw) == 21
        assert default_num_blocks(max_num_seqs=3, memory_cap_bytes=10_500, **kw) == 10
        with pytest.raises(InvalidConfigError, match="7 blocks"):
            default_num_blocks(max_num_seqs=3, memory_cap_bytes=6_999, **kw)
