"""The inputs of a decode-only step, written into buffers kept per batch shape.

A step in which every request has exactly one new token (the steady state of decoding)
needs no general metadata: rows, positions and sequence lengths are per-request numbers,
and the decode batch is the whole batch. :class:`DecodeInputs` fills one preallocated set
of arrays per batch shape (requests, blocks per request; the :data:`MAX_SHAPES` most
recently used) in place and hands out tensors
that view them (on CPU; a device copy elsewhere), instead of building ~25 temporary
arrays and tensors per step as :func:`~stages.forward.attention.build_attention_metadata`
does for a mixed batch. The metadata is the same, field for field.

The tensors of one step are valid until the next step of the same shape rewrites them:
the runner runs one step at a time and nothing keeps a step's metadata past its
forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pipeline.artifacts import ScheduledRequest
from stages.forward.attention import AttentionMetadata, DecodeBatch

__all__ = ["MAX_SHAPES", "DecodeInputs"]

MAX_SHAPES = 16
"""Buffer sets kept at most (the most recently used shapes): a server whose batch and
context sizes keep changing must not keep one per shape it ever saw."""


class _Buffers:
    """The arrays of one batch shape and the tensors that view them."""

    __slots__ = ("ids", "pos", "seq", "slots", "table", "tensors")

    def __init__(self, num_reqs: int, num_blocks: int, device: torch.device) -> None:
        self.ids = np.zeros(num_reqs, dtype=np.int64)
        self.pos = np.zeros(num_reqs, dtype=np.int64)
        self.seq = np.zeros(num_reqs, dtype=np.int64)
        self.slots = np.zeros(num_reqs, dtype=np.int64)
        self.table = np.zeros((num_reqs, num_blocks), dtype=np.int64)
        rows = np.arange(num_reqs, dtype=np.int64)
        starts = np.arange(num_reqs + 1, dtype=np.int64)
        self.tensors = {
            name: torch.from_numpy(a)
            for name, a in (("ids", self.ids), ("pos", self.pos), ("seq", self.seq),
                            ("slots", self.slots), ("table", self.table), ("rows", rows),
                            ("starts", starts))
        }  # fmt: skip
        if device.type != "cpu":  # constant ones are copied once
            for name in ("rows", "starts"):
                self.tensors[name] = self.tensors[name].to(device)


class DecodeInputs:
    """Builds the attention metadata of decode-only steps (one new token per request).

    Args:
        block_size: Tokens per KV block.
        device: Where the model runs; on CPU the tensors share the buffers' memory.
    """

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._on_cpu = device.type == "cpu"
        self._buffers: dict[tuple[int, int], _Buffers] = {}

    def build(
        self, requests: Sequence[ScheduledRequest], tables: Mapping[str, Sequence[int]]
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids, metadata, sample_rows)`` of a batch of one-token requests.

        Every request must have one new token and a block table that covers it (as
        :meth:`RequestStates.update` checked); every row is a sampled row. Not
        thread-safe (one step at a time, as the runner calls it).
        """
        bs = self.block_size
        ctx = [r.num_computed_tokens for r in requests]
        req_tables = [tables[r.req_id] for r in requests]
        needed = [c // bs + 1 for c in ctx]  # blocks that hold context + the new token
        key = (len(requests), max(needed))
        buf = self._buffers.pop(key, None)
        if buf is None:
            if len(self._buffers) >= MAX_SHAPES:
                del self._buffers[next(iter(self._buffers))]  # the least recently used
            buf = _Buffers(*key, self.device)
        self._buffers[key] = buf  # most recently used last
        # Per-request numbers in Python, one slice assignment per array: a small batch's
        # numpy calls (each several µs between two forward passes) cost more.
        buf.ids[:] = [r.token_ids[0] for r in requests]
        buf.pos[:] = ctx
        buf.seq[:] = [c + 1 for c in ctx]
        buf.slots[:] = [t[c // bs] * bs + c % bs for t, c in zip(req_tables, ctx, strict=True)]
        table = buf.table
        width = key[1]
        for i, n in enumerate(needed):
            table[i, :n] = req_tables[i][:n]
            if n < width:
                table[i, n:] = 0
        rows = buf.tensors["rows"]
        t = buf.tensors
        if not self._on_cpu:
            t = {**t, **{k: t[k].to(self.device) for k in ("ids", "pos", "seq", "slots", "table")}}
        same = min(ctx) == max(ctx)
        mask = None
        if not same:
            span = np.arange(width * bs)[None, :] < buf.seq[:, None]
            mask = torch.from_numpy(span).to(self.device)[:, None, None, :]
        decode = DecodeBatch(
            token_rows=rows,
            first_row=0,
            block_table=t["table"],
            seq_len=ctx[0] + 1 if same else None,
            mask=mask,
        )
        meta = AttentionMetadata(
            num_tokens=key[0],
            block_size=bs,
            query_start_loc=t["starts"],
            seq_lens=t["seq"],
            positions=t["pos"],
            slot_mapping=t["slots"],
            block_tables=t["table"],
            decode=decode,
            prefills=(),
        )
        return t["ids"], meta, rows
