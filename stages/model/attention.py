"""Paged attention over a flat batch that mixes prefill chunks and decode tokens.

:func:`build_attention_metadata` runs once per step and precomputes every index the
layers need (slot mapping, block gathers, masks), so each layer's
:func:`paged_attention` only writes the new K/V into the cache and calls
``scaled_dot_product_attention``: once for all decode requests together (one padded,
batched call) and once per prefill chunk. Nothing loops over tokens in Python.

A model with sliding-window layers (Gemma 3) derives a second metadata from the step's,
once per step, with :func:`sliding_window_metadata`: the same slots and block tables,
each query's keys cut to its window. Sliding layers keep every block of their context
(nothing is freed when it leaves the window; the cut is a mask or a key slice), so the
blocks, prefix caching and connectors are those of a full layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from stages.model.decode_mirror import MirrorStep

__all__ = [
    "PAD_MIN_NEW_TOKENS",
    "AttentionMetadata",
    "DecodeBatch",
    "PrefillChunk",
    "build_attention_metadata",
    "paged_attention",
    "pads_queries",
    "sliding_window_metadata",
    "write_kv",
]


@attrs.frozen(kw_only=True, eq=False)
class DecodeBatch:
    """All requests with one new token, attended to in one padded call.

    Attributes:
        token_rows: Rows of these tokens in the flat batch ``[n]``.
        first_row: ``start`` when ``token_rows`` is ``range(start, start + n)`` (sliced, not
            gathered), else ``None``.
        block_table: Blocks to gather per request ``[n, max_blocks]`` (padded with 0).
        seq_len: The context length every request shares, or ``None`` when they differ.
            Keys are then sliced to exactly ``seq_len`` (no mask, no padded keys), so
            attention sums over the same keys in the same order as an unpaged
            implementation (in bfloat16, padding would change the reduction's
            association and flip roundings). Not bit for bit transformers' bfloat16:
            the query heads of a KV head are one call's query rows (5x faster in
            torch's CPU kernel than one row per head), which now and then rounds an
            output element differently (greedy tokens of the bfloat16 oracle tests
            equal; 13 of 16 requests of 64 tokens in ``benchmarks/throughput.py``).
        mask: ``[n, 1, 1, max_blocks * block_size]``, True where a key is in context;
            ``None`` when ``seq_len`` is set.
        key_start: The first key attended to when ``seq_len`` is set (keys
            ``[key_start, seq_len)``): 0, or where a sliding window starts.
        mirror: Where these requests' keys and values are held contiguously
            (:class:`~stages.model.decode_mirror.DecodeMirror`): each layer copies in the
            positions a slot lacks and attends over the mirror instead of gathering
            blocks; ``None``: gather. Then ``paged_attention`` needs its ``layer``.
    """

    token_rows: torch.Tensor
    first_row: int | None
    block_table: torch.Tensor
    seq_len: int | None
    mask: torch.Tensor | None
    key_start: int = 0
    mirror: MirrorStep | None = None


@attrs.frozen(kw_only=True, eq=False)
class PrefillChunk:
    """One request's chunk of more than one new token.

    Attributes:
        start: First row of the chunk in the flat batch.
        end: One past its last row.
        context_len: Tokens already cached before the chunk.
        seq_len: ``context_len + (end - start)``.
        block_ids: Blocks holding the whole context, or ``None`` when ``context_len`` is 0
            (the chunk then attends to its own fresh K/V, causally).
        mask: ``[L, seq_len]``, True where key ``j`` is visible to query ``i``, or ``None``
            (no context, or :attr:`pad_queries`).
    """

    start: int
    end: int
    context_len: int
    seq_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None

    @property
    def pad_queries(self) -> bool:
        """Whether the chunk attends over its context without a mask: its queries put
        after ``context_len`` zero rows, the square call causal, the same values bit for
        bit (:func:`pads_queries` decided it, so no mask was built)."""
        return self.context_len > 0 and self.mask is None


PAD_MIN_NEW_TOKENS = 768
"""Fewest new tokens of a chunk over a cached context that :func:`pads_queries`."""


def pads_queries(context_len: int, new_tokens: int, device: torch.device) -> bool:
    """Whether a chunk of ``new_tokens`` over ``context_len`` cached tokens attends
    through a square causal call over zero-padded queries instead of a masked one.

    torch's CPU flash attention skips whole key blocks (512 keys) above the diagonal
    of a causal call, but computes every block of a masked one: with many new tokens
    over a short context the padded call is faster although it has ``context_len``
    more rows (bfloat16 on a 2-core EPYC: 1,024 new over 128 cached 12.7 against 17.0
    ms per layer, 2,048 over 256 42 against 68, 768 over 64 7.2 against 9.0), and
    slower when the context is as long as the chunk (512 over 512: 10.4 against 8.0).
    So it pads on a CPU from :data:`PAD_MIN_NEW_TOKENS` new tokens, at least twice the
    context. The rows each query sees and their order are the masked call's.
    """
    return (
        device.type == "cpu"
        and context_len > 0
        and new_tokens >= PAD_MIN_NEW_TOKENS
        and new_tokens >= 2 * context_len
    )


@attrs.frozen(kw_only=True, eq=False)
class AttentionMetadata:
    """Everything the layers need about one step's batch, built once per step.

    Attributes:
        num_tokens: Rows of the flat batch.
        block_size: Tokens per KV block.
        query_start_loc: ``[R + 1]`` offsets of each request's rows.
        seq_lens: ``[R]`` context + new tokens per request.
        positions: ``[T]`` position of each row in its sequence.
        slot_mapping: ``[T]`` cache slot each row's K/V is written to.
        block_tables: ``[R, max_blocks]`` block tables, padded with 0.
        decode: The decode requests, or ``None``.
        prefills: The prefill chunks, in batch order.
    """

    num_tokens: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    decode: DecodeBatch | None
    prefills: tuple[PrefillChunk, ...]


def build_attention_metadata(
    *,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build the metadata of one step; per-request Python, per-token work vectorised.

    Args:
        query_lens: New tokens per request (each >= 1), in batch order.
        context_lens: Tokens already in the cache per request.
        block_tables: Each request's block table; it must cover ``context + query`` tokens.
        block_size: Tokens per block.
        device: Where the tensors go (the model's device).

    Pure function; thread-safe.
    """
    num_reqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    seq = ctx + q_lens
    starts = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    num_tokens = int(starts[-1])
    needed = -(-seq // block_size)
    max_blocks = int(needed.max()) if num_reqs else 0
    table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        n = int(needed[i])
        assert len(blocks) >= n, f"block table of request {i} too short"
        table[i, :n] = blocks[:n]
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    positions = np.arange(num_tokens) - starts[req_of_token] + ctx[req_of_token]
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    table_t = to_dev(table)
    decode_idx = np.flatnonzero(q_lens == 1)
    decode = None
    if decode_idx.size:
        d_seq = seq[decode_idx]
        d_blocks = int(needed[decode_idx].max())
        span = d_blocks * block_size
        same = bool((d_seq == d_seq[0]).all())
        rows = starts[decode_idx]
        decode = DecodeBatch(
            token_rows=to_dev(rows),
            first_row=int(rows[0]) if bool((np.diff(rows) == 1).all()) else None,
            block_table=to_dev(np.ascontiguousarray(table[decode_idx, :d_blocks])),
            seq_len=int(d_seq[0]) if same else None,
            mask=None
            if same
            else to_dev(np.arange(span)[None, :] < d_seq[:, None])[:, None, None, :],
        )
    prefills = []
    for idx in np.flatnonzero(q_lens > 1):
        j = int(idx)
        c, s, n = int(ctx[j]), int(seq[j]), int(needed[j])
        mask = None
        if c and not pads_queries(c, s - c, device):
            q_pos = c + np.arange(int(q_lens[j]))
            mask = to_dev(np.arange(s)[None, :] <= q_pos[:, None])
        prefills.append(
            PrefillChunk(
                start=int(starts[j]),
                end=int(starts[j + 1]),
                context_len=c,
                seq_len=s,
                block_ids=to_dev(table[j, :n].copy()) if c else None,
                mask=mask,
            )
        )
    return AttentionMetadata(
        num_tokens=num_tokens,
        block_size=block_size,
        query_start_loc=to_dev(starts),
        seq_lens=to_dev(seq),
        positions=to_dev(positions),
        slot_mapping=to_dev(slots),
        block_tables=table_t,
        decode=decode,
        prefills=tuple(prefills),
    )


def sliding_window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """``meta`` for a sliding-window layer: a query at position ``p`` sees keys
    ``p - window < j <= p`` (transformers' ``sliding_window_overlay``: the window counts
    the query itself).

    Called once per step (not per layer), only by models with sliding layers. Decode
    requests that share a context length slice their keys to the window (no mask, the
    keys transformers' sliding cache holds); otherwise the decode mask also cuts keys
    older than each row's window. A prefill chunk whose sequence fits in the window is
    unchanged; a longer one gets a ``[L, seq_len]`` band mask. Tensor ops on ``meta``'s
    device only, no host synchronisation (a captured decode graph runs it). Pure
    function; the result shares ``meta``'s slots and block tables.
    """
    decode = meta.decode
    if decode is not None:
        if decode.seq_len is not None:
            if decode.seq_len > window:
                decode = attrs.evolve(decode, key_start=decode.seq_len - window)
        else:
            assert decode.mask is not None
            n, first = decode.token_rows.shape[0], decode.first_row
            pos = (meta.positions[first : first + n] if first is not None
                   else meta.positions.index_select(0, decode.token_rows))  # fmt: skip
            keys = torch.arange(decode.mask.shape[-1], device=pos.device)
            recent = keys[None, :] > (pos[:, None] - window)
            decode = attrs.evolve(decode, mask=decode.mask & recent[:, None, None, :])
    device = meta.positions.device
    prefills = tuple(
        chunk if chunk.seq_len <= window else attrs.evolve(chunk, mask=_band(chunk, window, device))
        for chunk in meta.prefills
    )
    return attrs.evolve(meta, decode=decode, prefills=prefills)


def _band(chunk: PrefillChunk, window: int, device: torch.device) -> torch.Tensor:
    """``[L, seq_len]``: True where key ``j`` is in query ``i``'s window, causally."""
    queries = torch.arange(chunk.context_len, chunk.seq_len, device=device)[:, None]
    keys = torch.arange(chunk.seq_len, device=device)[None, :]
    return (keys <= queries) & (keys > queries - window)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into their slots of ``kv_cache``."""
    kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: int = 0,
) -> torch.Tensor:
    """Write the new K/V into ``kv_cache``, then attend every query to its context.

    Args:
        query: ``[T, heads, head_dim]`` (already rotated).
        key: ``[T, kv_heads, head_dim]`` (already rotated).
        value: ``[T, kv_heads, head_dim]``.
        kv_cache: This layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        meta: The step's metadata.
        scale: Softmax scale (``head_dim ** -0.5`` for Llama).
        layer: The layer's index (its buffers of ``meta.decode.mirror``).

    Returns:
        ``[T, heads, head_dim]``. Each query sees its request's cached context plus the
        new tokens up to and including itself.
    """
    write_kv(kv_cache, key, value, meta)
    decode = meta.decode
    if decode is not None and decode.mirror is not None and not meta.prefills:
        whole = decode.first_row == 0 and decode.token_rows.shape[0] == query.shape[0]
        if whole and decode.mirror.order is None:  # every row, in slot order: no copy into out
            return _decode_mirrored(query, key, value, kv_cache, decode, None, scale, layer)
    num_heads, head_dim = query.shape[1:]
    kv_heads = key.shape[1]
    out = torch.empty_like(query)
    if decode is not None:
        if decode.mirror is None:
            _decode(query, kv_cache, decode, out, scale, kv_heads, num_heads)
        else:
            _decode_mirrored(query, key, value, kv_cache, decode, out, scale, layer)
    for chunk in meta.prefills:
        q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.pad_queries:  # causal over [context zeros | queries]: no mask
            padded = q.new_zeros(1, num_heads, chunk.seq_len, head_dim)
            padded[:, :, chunk.context_len :] = q
            q = padded
        if chunk.block_ids is None:
            k = key[chunk.start : chunk.end]
            v = value[chunk.start : chunk.end]
        else:
            k = kv_cache[0].index_select(0, chunk.block_ids).view(-1, kv_heads, head_dim)
            v = kv_cache[1].index_select(0, chunk.block_ids).view(-1, kv_heads, head_dim)
            k, v = k[: chunk.seq_len], v[: chunk.seq_len]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=kv_heads != num_heads,
        )
        if chunk.pad_queries:
            o = o[:, :, chunk.context_len :]
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: DecodeBatch,
    out: torch.Tensor,
    scale: float,
    kv_heads: int,
    num_heads: int,
) -> None:
    n = batch.token_rows.shape[0]
    head_dim = query.shape[-1]
    first = batch.first_row
    q = _rows(query, first, n, batch.token_rows)
    flat = batch.block_table.view(-1)
    k = kv_cache[0].index_select(0, flat).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    v = kv_cache[1].index_select(0, flat).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    # Grouped-query trick: the `group` query heads sharing a KV head become the query
    # length of one call, so keys and values are never repeated (and in bfloat16 torch's
    # CPU kernel runs 5x faster than with enable_gqa and one query per head).
    q = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
    if batch.seq_len is not None:
        # Exactly the context, as transformers sums it: no padded keys, no mask.
        k, v = k[:, :, batch.key_start : batch.seq_len], v[:, :, batch.key_start : batch.seq_len]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale)
    o = o.reshape(n, num_heads, head_dim)
    if first is not None:
        out[first : first + n] = o
    else:
        out.index_copy_(0, batch.token_rows, o)


def _decode_mirrored(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: DecodeBatch,
    out: torch.Tensor | None,
    scale: float,
    layer: int,
) -> torch.Tensor:
    """:func:`_decode` over the mirror's slots: the same keys, in the same order, of the
    same count (``[key_start, seq_len)`` or the mask's span), so the same sums. Writes
    the decode rows of ``out``, or returns them alone (``[n, heads, head_dim]``, in batch
    order) when ``out`` is ``None`` (the step is these rows, in slot order)."""
    mirror = batch.mirror
    assert mirror is not None
    num_heads = query.shape[1]
    kv_heads, head_dim = kv_cache.shape[-2:]
    keys, values = mirror.keys[layer], mirror.values[layer]
    n = batch.token_rows.shape[0]
    first = batch.first_row
    if mirror.fresh:  # each slot lacks its new token only: the step's own, as written
        for buf, new in ((keys, key), (values, value)):
            rows = _rows(new, first, n, batch.token_rows)
            buf.view(-1, head_dim).index_copy_(0, mirror.dst, rows.reshape(-1, head_dim))
    else:  # the positions each slot lacks, from the paged cache
        for buf, paged in ((keys, kv_cache[0]), (values, kv_cache[1])):
            rows = paged.view(-1, kv_heads, head_dim).index_select(0, mirror.src)
            buf.view(-1, head_dim).index_copy_(0, mirror.dst, rows.view(-1, head_dim))
    q = _rows(query, first, n, batch.token_rows)
    mask = batch.mask
    if mirror.order is not None:  # decode rows into slot order
        q = q.index_select(0, mirror.order)
        mask = None if mask is None else mask.index_select(0, mirror.order)
    if batch.seq_len is not None:
        start, end = batch.key_start, batch.seq_len
    else:
        assert mask is not None
        start, end = 0, mask.shape[-1]
    k, v = keys[:n, :, start:end], values[:n, :, start:end]
    q = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.reshape(n, num_heads, head_dim)
    if out is None:
        return o.contiguous()  # as the op's fake result is (compiled_forward)
    if mirror.rows is not None:
        out.index_copy_(0, mirror.rows, o)
    elif first is not None:
        out[first : first + n] = o
    else:
        out.index_copy_(0, batch.token_rows, o)
    return out


def _rows(x: torch.Tensor, first: int | None, n: int, token_rows: torch.Tensor) -> torch.Tensor:
    """The decode rows of ``x``: sliced when they are ``first..first+n-1``, else gathered."""
    return x[first : first + n] if first is not None else x.index_select(0, token_rows)
