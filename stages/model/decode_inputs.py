"""The inputs of a decode-only step, written into buffers kept per batch shape.

A step in which every request has exactly one new token (the steady state of decoding)
needs no general metadata: rows, positions and sequence lengths are per-request numbers,
and the decode batch is the whole batch. :class:`DecodeInputs` keeps one
:class:`DecodeBuffers` per batch shape (requests, blocks per request; the
:data:`MAX_SHAPES` most recently used), fills it in place and hands out tensors that view
it, instead of building ~25 temporary arrays and tensors per step as
:func:`~stages.model.attention.build_attention_metadata` does for a mixed batch. The
metadata is the same, field for field. On CUDA the inputs are written into a pinned
host buffer and reach the device in one copy. The decode graphs
(:mod:`stages.model.cuda_graphs`) use the same buffers, padded to their sizes.

The tensors of one step are valid until the next step of the same shape rewrites them:
the runner runs one step at a time and nothing keeps a step's metadata past its
forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pipeline.artifacts import ScheduledRequest
from stages.model.attention import AttentionMetadata, DecodeBatch
from stages.model.rope import LongRope

__all__ = ["MAX_SHAPES", "DecodeBuffers", "DecodeInputs"]

MAX_SHAPES = 16
"""Buffer sets kept at most (the most recently used shapes): a server whose batch and
context sizes keep changing must not keep one per shape it ever saw."""


class DecodeBuffers:
    """The inputs of one batch shape in one int64 buffer.

    Token ids, positions, context lengths + 1 and slots (``batch`` each), with
    ``long_rope`` the rotary-table rows (``batch``), then the block table (``batch x
    width``), written in place by :meth:`fill`. On CUDA they are written into a pinned
    host buffer and reach the device in one copy; on CPU the tensors view the buffer
    itself. The tensor attributes view the device's buffer; ``rope_rows`` is ``pos``
    without ``long_rope``; ``span`` is ``[0, width * block_size)``, the key positions of
    a row; ``rows`` and ``starts`` are ``[0, batch)`` and ``[0, batch]``.

    Args:
        batch: Rows (requests; padding rows included).
        width: Blocks per block-table row.
        block_size: Tokens per KV block.
        device: Where the model runs.
        long_rope: The model's longrope rule (:class:`~stages.model.rope.LongRope`),
            or ``None``.
    """

    __slots__ = ("_copied", "_fields", "_long_rope", "_pinned", "_rope_field", "batch",
                 "block_size", "host", "ids", "inputs", "pos", "rope_rows", "rows", "seq",
                 "slots", "span", "starts", "table", "width")  # fmt: skip

    def __init__(
        self,
        batch: int,
        width: int,
        block_size: int,
        device: torch.device,
        long_rope: LongRope | None = None,
    ) -> None:
        self.batch, self.width, self.block_size = batch, width, block_size
        self._pinned = device.type == "cuda"
        self._long_rope = long_rope
        n = 4 if long_rope is None else 5  # rows of per-request numbers
        self.host = torch.zeros(batch * (n + width), dtype=torch.int64, pin_memory=self._pinned)
        values = self.host.numpy()
        fields = values[: n * batch].reshape(n, batch)
        self._fields = (*fields[:4], values[n * batch :])
        self._rope_field = fields[4] if long_rope is not None else None
        self.inputs = self.host.to(device) if device.type != "cpu" else self.host
        self.ids, self.pos, self.seq, self.slots = self.inputs[: 4 * batch].view(4, batch)
        self.rope_rows = self.pos if long_rope is None else self.inputs[4 * batch : 5 * batch]
        self.table = self.inputs[n * batch :].view(batch, width)
        self.span = torch.arange(width * block_size, device=device)
        self.rows = torch.arange(batch, device=device)  # every row is sampled
        self.starts = torch.arange(batch + 1, device=device)  # one query token a row
        self._copied: torch.cuda.Event | None = None  # the last copy out of ``host``

    def fill(
        self, requests: Sequence[ScheduledRequest], tables: Mapping[str, Sequence[int]]
    ) -> list[int]:
        """Write the inputs of ``requests`` (one new token each; at most ``batch``) and
        send them to the device; returns their context lengths.

        Rows past ``len(requests)`` repeat row 0 (padding whose key and value go to row
        0's own slot). Each request's block table must cover its new token.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the host buffer
        ids = [r.token_ids[0] for r in requests]
        ctx = [r.num_computed_tokens for r in requests]
        req_tables = [tables[r.req_id] for r in requests]
        rows_ctx = ctx
        pad = self.batch - len(requests)
        if pad:
            ids += ids[:1] * pad
            rows_ctx = ctx + ctx[:1] * pad
            req_tables += req_tables[:1] * pad
        # Per-request numbers in Python, one slice assignment per field: a small batch's
        # numpy calls (each several µs between two forward passes) cost more.
        bs, width = self.block_size, self.width
        v_ids, v_pos, v_seq, v_slots, v_table = self._fields
        v_ids[:] = ids
        v_pos[:] = rows_ctx
        v_seq[:] = [c + 1 for c in rows_ctx]
        v_slots[:] = [t[c // bs] * bs + c % bs for t, c in zip(req_tables, rows_ctx, strict=True)]
        if self._rope_field is not None:
            assert self._long_rope is not None
            lens = [r.num_prompt_tokens for r in requests]
            self._rope_field[:] = self._long_rope.rows(rows_ctx, lens + lens[:1] * pad)
        table = v_table.reshape(self.batch, width)
        for i, (t, c) in enumerate(zip(req_tables, rows_ctx, strict=True)):
            n = c // bs + 1  # blocks that hold context + the new token
            table[i, :n] = t[:n]
            if n < width:
                table[i, n:] = 0
        if self.inputs is not self.host:
            self.inputs.copy_(self.host, non_blocking=True)
            if self._pinned:
                self._copied = torch.cuda.Event()
                self._copied.record()
        return ctx

    def metadata(self, seq_len: int | None) -> AttentionMetadata:
        """The metadata of the decode batch in these buffers (tensor ops only).

        Args:
            seq_len: The context length + 1 every row shares (keys are then sliced to
                it), or ``None``: keys are masked by each row's own, on the device.
        """
        mask = None
        if seq_len is None:
            mask = (self.span[None, :] < self.seq[:, None])[:, None, None, :]
        decode = DecodeBatch(
            token_rows=self.rows, first_row=0, block_table=self.table, seq_len=seq_len, mask=mask
        )
        return AttentionMetadata(
            num_tokens=self.batch,
            block_size=self.block_size,
            query_start_loc=self.starts,
            seq_lens=self.seq,
            positions=self.pos,
            slot_mapping=self.slots,
            block_tables=self.table,
            decode=decode,
            prefills=(),
        )


class DecodeInputs:
    """Builds the attention metadata of decode-only steps (one new token per request).

    Args:
        block_size: Tokens per KV block.
        device: Where the model runs; on CPU the tensors share the buffers' memory.
        long_rope: The model's longrope rule, or ``None``.

    Attributes:
        rope_rows: With ``long_rope``, the rotary-table rows of the last :meth:`build`
            (valid as its other tensors are); ``None`` without.
    """

    def __init__(
        self, block_size: int, device: torch.device, long_rope: LongRope | None = None
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.long_rope = long_rope
        self.rope_rows: torch.Tensor | None = None
        self._buffers: dict[tuple[int, int], DecodeBuffers] = {}

    def build(
        self, requests: Sequence[ScheduledRequest], tables: Mapping[str, Sequence[int]]
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids, metadata, sample_rows)`` of a batch of one-token requests (and,
        with ``long_rope``, :attr:`rope_rows`).

        Every request must have one new token and a block table that covers it (as
        :meth:`RequestStates.update` checked); every row is a sampled row. Not
        thread-safe (one step at a time, as the runner calls it).
        """
        bs = self.block_size
        width = max(r.num_computed_tokens for r in requests) // bs + 1
        key = (len(requests), width)
        buf = self._buffers.pop(key, None)
        if buf is None:
            if len(self._buffers) >= MAX_SHAPES:
                del self._buffers[next(iter(self._buffers))]  # the least recently used
            buf = DecodeBuffers(*key, bs, self.device, self.long_rope)
        self._buffers[key] = buf  # most recently used last
        ctx = buf.fill(requests, tables)
        if self.long_rope is not None:
            self.rope_rows = buf.rope_rows
        same = min(ctx) == max(ctx)
        return buf.ids, buf.metadata(ctx[0] + 1 if same else None), buf.rows
