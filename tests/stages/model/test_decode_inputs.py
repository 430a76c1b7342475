"""Decode-only steps: the buffered metadata equals the general builder's, field by field."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.artifacts import ScheduledRequest
from pipeline.config import SamplingParams
from stages.model.attention import AttentionMetadata, build_attention_metadata
from stages.model.decode_inputs import MAX_SHAPES, DecodeBuffers, DecodeInputs

CPU = torch.device("cpu")
BS = 4


def batch(ctx_lens: list[int]) -> tuple[list[ScheduledRequest], dict[str, list[int]]]:
    rng = random.Random(sum(ctx_lens))
    reqs = [
        ScheduledRequest(
            req_id=f"r{i}",
            token_ids=(rng.randrange(100),),
            num_computed_tokens=c,
            block_ids=(),
            new=False,
            sampling=SamplingParams(),
            sample=True,
            num_output_tokens=1,
        )
        for i, c in enumerate(ctx_lens)
    ]
    tables = {r.req_id: rng.sample(range(64), c // BS + 1 + rng.randrange(2)) for r, c in
              zip(reqs, ctx_lens, strict=True)}  # fmt: skip
    return reqs, tables


def reference(
    reqs: list[ScheduledRequest], tables: dict[str, list[int]], device: torch.device
) -> AttentionMetadata:
    """The general builder's metadata of the same decode batch."""
    return build_attention_metadata(
        query_lens=[1] * len(reqs),
        context_lens=[r.num_computed_tokens for r in reqs],
        block_tables=[tables[r.req_id] for r in reqs],
        block_size=BS,
        device=device,
    )


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool((a == b).all())


class TestDecodeInputs:
    @pytest.mark.parametrize("ctx_lens", [[5], [3, 3], [0, 7, 12], [4, 4, 4, 9], [15]])
    def test_matches_the_general_builder(self, ctx_lens: list[int]) -> None:
        """Same rows, positions, slots, tables, lengths and decode batch as the builder."""
        reqs, tables = batch(ctx_lens)
        builder = DecodeInputs(BS, CPU)
        for _ in range(2):  # the second build reuses the buffers
            ids, meta, rows = builder.build(reqs, tables)
            ref = reference(reqs, tables, CPU)
            assert ids.tolist() == [r.token_ids[0] for r in reqs]
            assert rows.tolist() == list(range(len(reqs)))
            assert meta.num_tokens == ref.num_tokens and meta.prefills == ref.prefills == ()
            for name in ("query_start_loc", "seq_lens", "positions", "slot_mapping",
                         "block_tables"):  # fmt: skip
                assert same(getattr(meta, name), getattr(ref, name)), name
            d, rd = meta.decode, ref.decode
            assert d is not None and rd is not None
            assert (d.first_row, d.seq_len) == (rd.first_row, rd.seq_len)
            assert same(d.token_rows, rd.token_rows) and same(d.block_table, rd.block_table)
            assert same(d.mask, rd.mask)

    def test_a_new_shape_gets_its_own_buffers(self) -> None:
        """A longer context (one more block) does not reuse a narrower table."""
        builder = DecodeInputs(BS, CPU)
        reqs, tables = batch([3])
        _, small, _ = builder.build(reqs, tables)
        reqs, tables = batch([4])
        _, wide, _ = builder.build(reqs, tables)
        assert small.block_tables.shape == (1, 1) and wide.block_tables.shape == (1, 2)

    def test_buffers_are_kept_for_the_most_recent_shapes_only(self) -> None:
        """Ever new shapes (batch size, blocks per request) keep at most MAX_SHAPES
        buffer sets, the least recently used dropped first; a kept one is reused."""
        builder = DecodeInputs(BS, CPU)
        first, tables = batch([3])
        ids, _, _ = builder.build(first, tables)
        for n in range(2, MAX_SHAPES + 1):  # MAX_SHAPES - 1 more shapes: all kept
            builder.build(*batch([3] * n))
        assert len(builder._buffers) == MAX_SHAPES
        again, _, _ = builder.build(first, tables)  # still there: the same memory
        assert again.data_ptr() == ids.data_ptr()
        builder.build(*batch([3] * (MAX_SHAPES + 1)))  # evicts the oldest, [3] * 2
        assert len(builder._buffers) == MAX_SHAPES
        assert (2, 1) not in builder._buffers and (1, 1) in builder._buffers


def test_padding_rows_repeat_row_0() -> None:
    """Filled for 2 requests into 4 rows: rows 2 and 3 are row 0 in every field (its
    token, position, length, slot and table), and the real rows are the requests'."""
    reqs, tables = batch([5, 2])
    buf = DecodeBuffers(4, 3, BS, CPU)
    assert buf.fill(reqs, tables) == [5, 2]
    for field in (buf.ids, buf.pos, buf.seq, buf.slots, buf.table):
        assert same(field[2], field[0]) and same(field[3], field[0])
    assert buf.pos.tolist() == [5, 2, 5, 5] and buf.seq.tolist() == [6, 3, 6, 6]
    t0 = tables["r0"]
    assert buf.slots[0].item() == t0[1] * BS + 1 and buf.table[0].tolist() == [*t0[:2], 0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buffers_match_the_builder_step_after_step() -> None:
    """On CUDA (a pinned host buffer, one copy a step): every step's device tensors equal
    the general builder's, also when the same buffers are refilled at once for the next
    step (the refill waits until the copy has read the host buffer)."""
    cuda = torch.device("cuda")
    builder = DecodeInputs(BS, cuda)
    seen = []
    for step in range(50):
        ctx_lens = [4 + step % 3, 9]  # the same shape every step: the buffers are reused
        reqs, tables = batch(ctx_lens)
        ids, meta, _ = builder.build(reqs, tables)
        seen.append((ids.clone(), meta.slot_mapping.clone(), meta.block_tables.clone(), reqs,
                     tables))  # fmt: skip
    for ids, slots, table, reqs, tables in seen:
        ref = reference(reqs, tables, cuda)
        assert ids.tolist() == [r.token_ids[0] for r in reqs]
        assert same(slots, ref.slot_mapping) and same(table, ref.block_tables)
