"""A contiguous copy of the decode requests' KV, appended to instead of regathered.

Decode attention over the paged cache gathers every request's blocks (``index_select``
over the block table) in every layer of every step, about half of a CPU decode step's
attention. :class:`DecodeMirror` keeps, per layer, K and V buffers ``[slots, kv_heads, L,
head_dim]`` in which each decode request owns one slot (a row) holding its positions
``[0, length)``; a step then copies only the positions a slot lacks (in steady decoding:
the new token) and attends over ``mirror[:n, :, :span]`` (:func:`~stages.model.attention.
paged_attention` with ``DecodeBatch.mirror``). Head-major, so that each head's keys are
contiguous: torch's CPU attention kernel reads them 1.6-1.8x faster than with the
paged cache's position-major rows (bfloat16, 8 to 64 requests of 450-530 keys).

The paged cache stays the source of truth; the mirror is a cache of it:

* every scheduled request's slot is cut to its ``num_computed_tokens`` each step (a step
  rewrites the positions from there: rejected drafts, a recomputed chunk), and a request
  scheduled ``new`` (a resumed preemption) or dropped (``finished_req_ids``) leaves;
* a step's decode requests are exactly the occupied slots ``0..n-1`` (one that is not in
  the batch leaves: its last slot moves into its hole, one row copy per layer); a slot
  that lacks positions copies them from the paged cache in the layer's attention, after
  the step's K/V are written there and after a connector's load of that layer; when
  every slot lacks only its new token (steady decoding: ``MirrorStep.fresh``) the layer
  copies the step's new keys and values themselves, the values the paged cache just
  got, without reading them back (two gathers fewer per layer).

The buffers grow by doubling; a step that would take them past ``budget_bytes`` attends
through the paged cache as before (counted in :attr:`DecodeMirror.fallbacks`, logged once).
Not thread-safe: owned by one :class:`~stages.model.runner.ModelRunner`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from pipeline.artifacts import ScheduledRequest
from pipeline.logger import get_logger

__all__ = ["DecodeMirror", "MirrorStep"]

log = get_logger()


@attrs.frozen(kw_only=True, eq=False)
class MirrorStep:
    """What one step's decode attention reads from the mirror, per layer.

    Attributes:
        keys: Per layer ``[slots, kv_heads, L, head_dim]`` (slot ``s`` holds positions
            ``[0, L)`` of its request, valid up to its length).
        values: Likewise.
        src: ``[C]`` paged-cache slots (``block * block_size + offset``) to copy in...
        dst: ``[C * kv_heads]`` ...each head of them to these rows of the buffer
            flattened to ``[slots * kv_heads * L, head_dim]`` (``(slot * kv_heads + head)
            * L + position``).
        order: ``[n]`` the decode-batch row of each slot, or ``None`` when slot ``s`` is row
            ``s``.
        rows: ``[n]`` the flat-batch row of each slot's query (``token_rows[order]``), or
            ``None`` with ``order``.
        fresh: Whether each slot lacks only its new token (steady decoding): ``src`` is
            then the decode rows' own slots, in decode-batch order, and the layer copies
            the step's new keys and values straight into ``dst`` (the same values the
            paged cache got) instead of reading them back from the cache.
    """

    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    src: torch.Tensor
    dst: torch.Tensor
    order: torch.Tensor | None
    rows: torch.Tensor | None
    fresh: bool = False


class DecodeMirror:
    """Per-layer contiguous K/V of the decode requests, slot bookkeeping shared by layers.

    Args:
        num_layers: Layers (one K and one V buffer each).
        kv_heads: This rank's KV heads.
        head_dim: Width of a head.
        block_size: Tokens per paged-cache block.
        dtype: The cache's dtype.
        device: The cache's device.
        budget_bytes: Most bytes the buffers of all layers may take.

    Attributes:
        fallbacks: Steps whose decode batch did not fit in ``budget_bytes`` (attended
            through the paged cache).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.budget_bytes = budget_bytes
        self.fallbacks = 0
        self._slots_cap = 0
        self._len_cap = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._slot: dict[str, int] = {}
        self._ids: list[str] = []  # request of each occupied slot
        self._lens: list[int] = []  # positions each slot holds

    def __len__(self) -> int:
        return len(self._ids)

    def length(self, req_id: str) -> int | None:
        """Positions the slot of ``req_id`` holds, or ``None`` when it has none."""
        slot = self._slot.get(req_id)
        return None if slot is None else self._lens[slot]

    def drop(self, req_ids: Iterable[str]) -> None:
        """Free the slots of ``req_ids`` (unknown ids are ignored)."""
        for req_id in req_ids:
            if req_id in self._slot:
                self._evict(req_id)

    def clear(self) -> None:
        """Free every slot and the buffers."""
        self._slot.clear()
        self._ids.clear()
        self._lens.clear()
        self._keys, self._values = [], []
        self._slots_cap = self._len_cap = 0

    def observe(self, requests: Sequence[ScheduledRequest]) -> None:
        """Apply a step's requests: each slot cut to its request's context, a ``new``
        request's slot freed. Call it for every step, before its forward pass."""
        for r in requests:
            slot = self._slot.get(r.req_id)
            if slot is None:
                continue
            if r.new:
                self._evict(r.req_id)
            elif self._lens[slot] > r.num_computed_tokens:
                self._lens[slot] = r.num_computed_tokens

    def step(
        self,
        requests: Sequence[ScheduledRequest],
        tables: Mapping[str, Sequence[int]],
        token_rows: torch.Tensor,
    ) -> MirrorStep | None:
        """Make the slots ``0..n-1`` those of the decode ``requests`` (one new token
        each, in decode-batch order) and return what their attention reads; ``None``
        when the buffers would pass the budget (a fallback: counted, logged once).

        Assumes :meth:`observe` saw the step. Each slot holds positions ``[0, context +
        1)`` once the step's layers ran.
        """
        wanted = {r.req_id for r in requests}
        for req_id in [i for i in self._ids if i not in wanted]:
            self._evict(req_id)
        bs = self.block_size
        n = len(requests)
        span = (max(r.num_computed_tokens for r in requests) // bs + 1) * bs
        if not self._fits(n, span):
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning(
                    "decode_mirror_fallback",
                    budget_bytes=self.budget_bytes,
                    requests=n,
                    keys=span,
                    note="decode attention gathers from the paged cache while over budget",
                )
            return None
        for r in requests:
            if r.req_id not in self._slot:
                self._slot[r.req_id] = len(self._ids)
                self._ids.append(r.req_id)
                self._lens.append(0)
        cap = self._len_cap
        src: list[int] = []
        dst: list[int] = []  # head 0's row; head h's is h * cap further
        order = [0] * n
        identity = True
        fresh = True
        for i, r in enumerate(requests):
            slot = self._slot[r.req_id]
            order[slot] = i
            identity = identity and slot == i
            table = tables[r.req_id]
            held, ctx = self._lens[slot], r.num_computed_tokens
            fresh = fresh and held == ctx
            base = slot * self.kv_heads * cap
            for pos in range(held, ctx + 1):
                src.append(table[pos // bs] * bs + pos % bs)
                dst.append(base + pos)
            self._lens[slot] = ctx + 1
        device = self.device
        order_t = None if identity else torch.tensor(order, device=device)
        heads = torch.arange(self.kv_heads, dtype=torch.int64, device=device) * cap
        dst_t = torch.tensor(dst, dtype=torch.int64, device=device)
        return MirrorStep(
            keys=self._keys,
            values=self._values,
            src=torch.tensor(src, dtype=torch.int64, device=device),
            dst=(dst_t[:, None] + heads[None, :]).view(-1),
            order=order_t,
            rows=None if order_t is None else token_rows.index_select(0, order_t),
            fresh=fresh,
        )

    def _bytes(self, slots: int, length: int) -> int:
        per = self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * slots * length * per

    def _fits(self, n: int, span: int) -> bool:
        """Grow the buffers (doubling) to ``n`` slots of ``span`` keys; False when that
        passes the budget (nothing changes then).

        New buffers are zeroed: a masked key's weight is an exact 0, but ``0 * nan`` of
        uninitialised memory is not (the paged cache is zeroed alike)."""
        slots, length = max(self._slots_cap, 1), max(self._len_cap, self.block_size)
        while slots < n:
            slots *= 2
        while length < span:
            length *= 2
        if slots == self._slots_cap and length == self._len_cap:
            return True
        if self._bytes(slots, length) > self.budget_bytes:
            slots, length = n, span  # exactly what this step needs, no doubling
            if self._bytes(slots, length) > self.budget_bytes:
                return False
        shape = (slots, self.kv_heads, length, self.head_dim)
        # Slots 0..keep-1 (at most n: the others left) hold fewer than span positions.
        keep, held = len(self._ids), min(self._len_cap, length)
        keys, values = [], []
        for old_k, old_v in zip(self._keys, self._values, strict=True) if keep else ():
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            k[:keep, :, :held] = old_k[:keep, :, :held]
            v[:keep, :, :held] = old_v[:keep, :, :held]
            keys.append(k)
            values.append(v)
        if not keep:
            self._keys, self._values = [], []  # free before allocating
            keys = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                    for _ in range(self.num_layers)]  # fmt: skip
            values = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                      for _ in range(self.num_layers)]  # fmt: skip
        self._keys, self._values = keys, values
        self._slots_cap, self._len_cap = slots, length
        return True

    def _evict(self, req_id: str) -> None:
        """Free ``req_id``'s slot: the last slot moves into it (one row copy per layer)."""
        slot = self._slot.pop(req_id)
        last = len(self._ids) - 1
        if slot != last:
            moved = self._ids[last]
            held = self._lens[last]
            for k, v in zip(self._keys, self._values, strict=True):
                k[slot, :, :held] = k[last, :, :held]
                v[slot, :, :held] = v[last, :, :held]
            self._ids[slot], self._lens[slot] = moved, held
            self._slot[moved] = slot
        self._ids.pop()
        self._lens.pop()
