"""Paged attention metadata, the KV cache layout and sizing."""

from __future__ import annotations

import attrs
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
from stages.model.attention import PAD_MIN_NEW_TOKENS, pads_queries, sliding_window_metadata
from stages.model.decode_inputs import DecodeBuffers

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


class TestPaddedQueries:
    """A long chunk over a short cached context attends through a square causal call
    over zero-padded queries (faster in torch's CPU kernel), the masked call's values."""

    def test_when_it_pads(self) -> None:
        assert pads_queries(128, 1024, CPU) and pads_queries(64, PAD_MIN_NEW_TOKENS, CPU)
        assert not pads_queries(0, 1024, CPU)  # no context: causal already
        assert not pads_queries(512, 512, CPU)  # as long a context: the mask is faster
        assert not pads_queries(64, PAD_MIN_NEW_TOKENS - 1, CPU)
        assert not pads_queries(128, 1024, torch.device("cuda"))  # measured on a CPU only

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_equals_the_masked_call_bit_for_bit(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        bs, heads, kv_heads, hd, ctx, new = 16, 4, 2, 8, 100, 800
        cache = torch.zeros(2, 64, bs, kv_heads, hd, dtype=dtype)
        table = [list(range(3, 3 + 57))]
        q, k, v = (torch.randn(ctx + new, h, hd, generator=gen).to(dtype)
                   for h in (heads, kv_heads, kv_heads))  # fmt: skip
        first = build_attention_metadata(
            query_lens=[ctx], context_lens=[0], block_tables=table, block_size=bs, device=CPU
        )
        paged_attention(q[:ctx], k[:ctx], v[:ctx], cache, first, hd**-0.5)
        meta = build_attention_metadata(
            query_lens=[new], context_lens=[ctx], block_tables=table, block_size=bs, device=CPU
        )
        (chunk,) = meta.prefills
        assert chunk.pad_queries and chunk.mask is None
        out = paged_attention(q[ctx:], k[ctx:], v[ctx:], cache, meta, hd**-0.5)
        visible = torch.arange(ctx + new)[None, :] <= torch.arange(ctx, ctx + new)[:, None]
        masked = attrs.evolve(meta, prefills=(attrs.evolve(chunk, mask=visible),))
        assert torch.equal(out, paged_attention(q[ctx:], k[ctx:], v[ctx:], cache, masked, hd**-0.5))
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            k.repeat_interleave(2, 1).transpose(0, 1).float(),
            v.repeat_interleave(2, 1).transpose(0, 1).float(),
            is_causal=True,
        ).transpose(0, 1)[ctx:]
        assert torch.allclose(out.float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)

    def test_a_sliding_window_keeps_its_band(self) -> None:
        meta = build_attention_metadata(
            query_lens=[800], context_lens=[100], block_tables=[list(range(57))],
            block_size=16, device=CPU,
        )  # fmt: skip
        (chunk,) = sliding_window_metadata(meta, 64).prefills
        assert not chunk.pad_queries and chunk.mask is not None


def _band(n: int, window: int) -> torch.Tensor:
    """``[n, n]``: query ``i`` sees keys ``i - window < j <= i`` (transformers')."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (j > i - window)


class TestSlidingWindowMetadata:
    def test_matches_dense_windowed_attention(self) -> None:
        """Decodes of different lengths (masked), a continued prefill and a new one
        longer than the window attend to exactly their window of 4 keys."""
        gen = torch.Generator().manual_seed(0)
        bs, heads, kv_heads, hd, window = 4, 4, 2, 8, 4
        cache = torch.zeros(2, 16, bs, kv_heads, hd)
        full = {n: tuple(torch.randn(n, h, hd, generator=gen) for h in (heads, kv_heads, kv_heads))
                for n in (6, 10, 9, 7)}  # fmt: skip
        tables = {6: [3, 5], 10: [12, 13, 14], 9: [0, 11, 2], 7: [8, 9]}
        ctx = {6: 5, 10: 9, 9: 3, 7: 0}  # 6 and 10 decode, 9 continues a prefill, 7 is new
        warm = [n for n in full if ctx[n]]
        pre = build_attention_metadata(
            query_lens=[ctx[n] for n in warm], context_lens=[0] * len(warm),
            block_tables=[tables[n] for n in warm], block_size=bs, device=CPU,
        )  # fmt: skip
        q, k, v = (torch.cat([full[n][i][: ctx[n]] for n in warm]) for i in range(3))
        paged_attention(q, k, v, cache, sliding_window_metadata(pre, window), hd**-0.5)
        meta = build_attention_metadata(
            query_lens=[len(full[n][0]) - ctx[n] for n in full], context_lens=list(ctx.values()),
            block_tables=list(tables.values()), block_size=bs, device=CPU,
        )  # fmt: skip
        windowed = sliding_window_metadata(meta, window)
        assert windowed.decode is not None and windowed.decode.mask is not None
        q, k, v = (torch.cat([full[n][i][ctx[n] :] for n in full]) for i in range(3))
        out = paged_attention(q, k, v, cache, windowed, hd**-0.5)
        rows = 0
        for n, (q, k, v) in full.items():
            ref = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.repeat_interleave(2, 1).transpose(0, 1),
                v.repeat_interleave(2, 1).transpose(0, 1),
                attn_mask=_band(n, window),
            ).transpose(0, 1)[ctx[n] :]
            got = out[rows : rows + len(ref)]
            rows += len(ref)
            assert torch.allclose(got, ref, atol=1e-5), n

    def test_equal_length_decodes_slice_keys_to_the_window(self) -> None:
        """Decodes sharing a context length keep no mask and start at the window's first
        key; within the window nothing changes."""

        def decode_of(context: int, window: int) -> tuple[int, int | None, bool]:
            meta = build_attention_metadata(
                query_lens=[1, 1], context_lens=[context] * 2, block_tables=[[0, 1], [2, 3]],
                block_size=16, device=CPU,
            )  # fmt: skip
            decode = sliding_window_metadata(meta, window).decode
            assert decode is not None
            return decode.key_start, decode.seq_len, decode.mask is None

        assert decode_of(20, 8) == (13, 21, True)  # keys 13..20: the query's 8
        assert decode_of(7, 8) == (0, 8, True)
        assert decode_of(20, 21) == (0, 21, True)

    def test_prefills_within_the_window_are_unchanged(self) -> None:
        """A chunk whose whole sequence fits in the window keeps its causal metadata."""
        meta = build_attention_metadata(
            query_lens=[5, 3], context_lens=[0, 4], block_tables=[[0, 1], [2, 3]],
            block_size=4, device=CPU,
        )  # fmt: skip
        windowed = sliding_window_metadata(meta, 8)
        assert windowed.prefills == meta.prefills
        cut = sliding_window_metadata(meta, 4).prefills
        assert cut[0].mask is not None and torch.equal(cut[0].mask, _band(5, 4))
        assert cut[1].mask is not None and torch.equal(cut[1].mask, _band(7, 4)[4:])

    def test_decode_buffers_mask_each_row_by_its_window(self) -> None:
        """The decode buffers' padded metadata (what a captured graph runs) is masked
        per row: keys in ``(position - window, position]`` only."""
        buf = DecodeBuffers(2, 2, 4, CPU)
        buf.seq[:] = torch.tensor([7, 3])
        buf.pos[:] = torch.tensor([6, 2])
        decode = sliding_window_metadata(buf.metadata(None), 3).decode
        assert decode is not None and decode.mask is not None
        assert decode.mask[:, 0, 0].int().tolist() == [
            [0, 0, 0, 0, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
        ]


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
