"""Multi-LoRA on the worker: a batch mixes base rows and rows of different adapters.

With ``enable_lora``, :func:`attach_lora` wraps each projection an adapter may target
(q/k/v/o, gate/up/down, or the packed ``qkv_proj``/``gate_up_proj`` they became) in a
:class:`LoRAProjection`: the base projection, then ``out[rows] += scaling * (x[rows] @
A^T) @ B^T`` for each adapter of the step, on that adapter's rows only. Every slot's
``A`` and ``B`` of a projection live side by side in one :class:`Stack`, so the updates
take one of two shapes (never a loop over tokens): for a small step of several adapters
(decoding), one masked pair of GEMMs over all slots (``x @ A_all^T``, each row's columns
of other slots zeroed, ``@ B_all``: four ops, whatever the mix, as punica's BGMV does in
one kernel); otherwise one pair per adapter on its rows (a view when they lie in one run
of the batch, else one gather), as its SGMV. A row-parallel projection
(``o_proj``/``down_proj`` of a tensor-parallel shard) adds its update to its partial
product, before the all-reduce, with ``A`` split as the weight's input columns;
column-parallel ones split ``B`` as the weight's output rows.

:class:`LoRASlots` is a runner's ``max_loras`` slots, least recently used out first: an
adapter's weights are cast, scaled (``scaling`` folded into ``B``) and sharded once, when
they are written into a slot of the stacks. The step's adapters and rows reach the
projections through a context variable set around the forward pass (:func:`lora_step`),
so a model shared by in-process ranks never holds one rank's step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.artifacts import ScheduledRequest
from pipeline.errors import InvalidRequestError
from pipeline.lora import LoRAAdapter
from stages.model.config import ModelConfig
from stages.model.layers import MLP, Attention, DecoderLayer, forget_references
from stages.model.lora_files import PACKED_TARGETS, cached_adapter, lora_shapes
from stages.model.parallel import RowParallelLinear, TensorParallel, shard_slice

__all__ = ["LoRAProjection", "LoRASlots", "LoRAStep", "Stack", "attach_lora", "lora_step"]

_PARENTS = (("self_attn", ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_up_proj", "gate_proj", "up_proj", "down_proj")))  # fmt: skip

Rows = slice | torch.Tensor
"""A run of the batch's rows (a view), or their indices (a gather)."""

DENSE_MAX_ROWS_X_SLOTS = 128
"""A step of several adapters whose rows times ``max_loras`` is at most this (decode
steps) applies every slot in one masked pair of GEMMs per projection; larger steps (and
one-adapter steps) run one pair per adapter on its own rows."""


@attrs.frozen(eq=False)
class Stack:
    """One wrapped projection's adapters, every slot side by side.

    Attributes:
        a: ``[slots * rank, in]``: slot ``s``'s ``A`` in rows ``s * rank`` on, each
            part of a packed projection ``max_lora_rank`` rows of its own.
        b: ``[slots * rank, out]``: ``B`` transposed and scaled, in the same rows, each
            part's in its own output columns; zero where a slot's adapter does not reach.
        rank: Rows per slot.
    """

    a: torch.Tensor
    b: torch.Tensor
    rank: int


@attrs.frozen(eq=False)
class LoRAStep:
    """The adapters of one forward pass.

    Attributes:
        stacks: The runner's stacks, by ``(layer, projection name)``.
        groups: Each adapter's rows and slot (the per-adapter path), or ``()``.
        masks: Rows per slot → ``[rows, slots * rank]``, 1 where a row's adapter owns
            the column (the masked path), or ``None``.
    """

    stacks: Mapping[tuple[int, str], Stack]
    groups: tuple[tuple[Rows, int], ...] = ()
    masks: Mapping[int, torch.Tensor] | None = None


_STEP: contextvars.ContextVar[LoRAStep | None] = contextvars.ContextVar(
    "kvstep_lora_step", default=None
)


class LoRAProjection(nn.Module):
    """A projection plus the low-rank updates of the step's adapters, on their rows.

    Args:
        base: The projection (``nn.Linear``, a packed oneDNN one, or a row-parallel one).
        key: ``(layer, name)`` of the projection in the slots' stacks.
    """

    def __init__(self, base: nn.Module, key: tuple[int, str]) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self._row_parallel = isinstance(base, RowParallelLinear)
        self._linear = type(base) is nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if self._row_parallel:
            assert isinstance(base, RowParallelLinear)
            out = F.linear(x, base.weight)
        elif self._linear:
            assert isinstance(base, nn.Linear)
            out = F.linear(x, base.weight, base.bias)
        else:
            out = base(x)
        step = _STEP.get()
        stack = None if step is None else step.stacks.get(self.key)
        if stack is not None:
            assert step is not None
            _add_updates(out, x, stack, step)
        if self._row_parallel:
            assert isinstance(base, RowParallelLinear)
            out = base.tp.reduce(out)
            if base.bias is not None:
                out += base.bias
        return out

    def extra_repr(self) -> str:
        return f"layer={self.key[0]}, {self.key[1]}"


def _add_updates(out: torch.Tensor, x: torch.Tensor, stack: Stack, step: LoRAStep) -> None:
    if step.masks is not None:
        h = (x @ stack.a.t()).mul_(step.masks[stack.rank])
        out.addmm_(h, stack.b)
        return
    r = stack.rank
    for rows, slot in step.groups:
        a, b = stack.a[slot * r : (slot + 1) * r], stack.b[slot * r : (slot + 1) * r]
        if isinstance(rows, slice):
            out[rows].addmm_(x[rows] @ a.t(), b)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b)


def attach_lora(model: nn.Module) -> int:
    """Wrap every projection of ``model``'s layers that an adapter may target in a
    :class:`LoRAProjection` (once: wrapped ones are left); the number wrapped. Call
    after the linear kernel is applied (it may pack projections: the packed one is
    wrapped, its parts are views the layer never calls)."""
    wrapped = 0
    for decoder in model.modules():
        if not isinstance(decoder, DecoderLayer):
            continue
        layer = decoder.self_attn.layer
        for parent_name, names in _PARENTS:
            parent = decoder._modules.get(parent_name)
            if not isinstance(parent, Attention | MLP):
                continue  # a mixture of experts: no adapter targets it
            for name in names:
                child = parent._modules.get(name)
                packed = any(name in parts and fused in parent._modules
                             for fused, parts in PACKED_TARGETS.items())  # fmt: skip
                if child is None or packed or isinstance(child, LoRAProjection):
                    continue
                parent._modules[name] = LoRAProjection(child, (layer, name))
                wrapped += 1
    forget_references(model)
    return wrapped


@contextlib.contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """Make ``step`` the one the projections of this thread apply, for the body of the
    block (``None``: no adapter)."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


class LoRASlots:
    """A runner's adapters: ``max_loras`` slots, least recently used out first, held
    as one :class:`Stack` per projection an adapter targets.

    Args:
        config: The base model's configuration (the adapters are checked against it).
        tp: How the model is sharded (the updates are split as the weights are).
        max_loras: Slots.
        max_rank: Largest rank accepted (``max_lora_rank``); each part of a stack
            takes that many rows per slot.
        dtype: The model's dtype; updates are applied in it.
        device: Where the model is.

    Not thread-safe: one runner's calls, one at a time.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.tp = tp
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # content id → slot, LRU first
        self._stacks: dict[tuple[int, str], Stack] = {}
        self._fused: dict[str, str] = {}  # a packed part → the packed projection
        self._shapes = lora_shapes(config)
        self._columns: dict[int, torch.Tensor] = {}  # rows per slot → each column's slot

    def attach(self, model: nn.Module) -> None:
        """Wrap ``model``'s projections (:func:`attach_lora`) and learn which of them
        are packed."""
        attach_lora(model)
        for module in model.modules():
            for fused, parts in PACKED_TARGETS.items():
                if fused in module._modules:
                    self._fused.update(dict.fromkeys(parts, fused))

    def step(self, requests: Sequence[ScheduledRequest]) -> LoRAStep | None:
        """The adapters and rows of a batch of ``requests`` (rows in their order, as
        many per request as it schedules), loading those not in a slot; ``None`` when no
        request has one.

        Raises:
            InvalidRequestError: More adapters than ``max_loras``, or one that cannot
                be read (:func:`~stages.model.lora_files.cached_adapter`).
        """
        runs: dict[str, list[tuple[int, int]]] = {}
        adapters: dict[str, LoRAAdapter] = {}
        row = 0
        for r in requests:
            n = r.num_scheduled_tokens
            if r.lora is not None:
                key = r.lora.content_id
                adapters[key] = r.lora
                spans = runs.setdefault(key, [])
                if spans and spans[-1][1] == row:
                    spans[-1] = (spans[-1][0], row + n)
                else:
                    spans.append((row, row + n))
            row += n
        if not runs:
            return None
        if len(runs) > self.max_loras:
            raise InvalidRequestError(
                "lora_request", sorted(a.name for a in adapters.values()),
                f"a step may hold at most max_loras={self.max_loras} adapters",
            )  # fmt: skip
        slots = {key: self._load(adapters[key], keep=runs.keys()) for key in runs}
        if len(runs) > 1 and row * self.max_loras <= DENSE_MAX_ROWS_X_SLOTS:
            return LoRAStep(self._stacks, masks=self._masks(runs, slots, row))
        groups = []
        for key, spans in runs.items():
            rows: Rows
            if len(spans) == 1:
                rows = slice(*spans[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device)
            groups.append((rows, slots[key]))
        return LoRAStep(self._stacks, groups=tuple(groups))

    def _masks(
        self, runs: Mapping[str, list[tuple[int, int]]], slots: Mapping[str, int], n: int
    ) -> dict[int, torch.Tensor]:
        """Rows per slot → which columns of the stacks each of the ``n`` rows takes."""
        owner = torch.full((n,), -1, dtype=torch.long)
        for key, spans in runs.items():
            for a, b in spans:
                owner[a:b] = slots[key]
        owner = owner.to(self.device)
        masks = {}
        for rank in {stack.rank for stack in self._stacks.values()}:
            columns = self._columns.get(rank)
            if columns is None:
                columns = torch.arange(self.max_loras, device=self.device)
                columns = self._columns[rank] = columns.repeat_interleave(rank)
            masks[rank] = (owner[:, None] == columns[None, :]).to(self.dtype)
        return masks

    def _load(self, adapter: LoRAAdapter, keep: Collection[str]) -> int:
        """``adapter``'s slot: the one it has, or the least recently used one whose
        adapter is not in ``keep`` (the step's), written with its updates."""
        key = adapter.content_id
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        weights = cached_adapter(adapter, self.config, max_rank=self.max_rank)
        taken = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(k for k in self._slot_of if k not in keep)
            slot = self._slot_of.pop(victim)
        self._write(slot, weights.tensors, weights.targets, weights.scaling)
        self._slot_of[key] = slot
        return slot

    def _write(
        self,
        slot: int,
        tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        targets: tuple[str, ...],
        scaling: float,
    ) -> None:
        """Put an adapter's updates in ``slot`` of every stack (zero where it has none):
        its parts' ``A`` and scaled ``B``, split as this rank's weights are, in the
        model's dtype."""
        for stack in self._stacks.values():
            stack.a[slot * stack.rank : (slot + 1) * stack.rank].zero_()
            stack.b[slot * stack.rank : (slot + 1) * stack.rank].zero_()
        for layer in range(self.config.num_hidden_layers):
            for target in targets:
                name = self._fused.get(target, target)
                parts = PACKED_TARGETS.get(name, (name,))
                a, b = self._shard(layer, target, *tensors[layer, target])
                stack = self._stack(layer, name, parts, a.shape[1])
                index = parts.index(target)
                row = slot * stack.rank + index * self.max_rank
                column = sum(self._width(layer, p) for p in parts[:index])
                r, width = a.shape[0], b.shape[0]
                stack.a[row : row + r] = a.to(self.device, self.dtype)
                b_t = (b * scaling).t().to(self.device, self.dtype)
                stack.b[row : row + r, column : column + width] = b_t

    def _stack(self, layer: int, name: str, parts: tuple[str, ...], fan_in: int) -> Stack:
        """The stack of ``(layer, name)``, allocated (zero) the first time."""
        stack = self._stacks.get((layer, name))
        if stack is None:
            rank = self.max_rank * len(parts)
            fan_out = sum(self._width(layer, p) for p in parts)
            zeros = functools.partial(torch.zeros, device=self.device, dtype=self.dtype)
            stack = Stack(
                zeros(self.max_loras * rank, fan_in), zeros(self.max_loras * rank, fan_out), rank
            )
            self._stacks[layer, name] = stack
        return stack

    def _width(self, layer: int, part: str) -> int:
        """This rank's output width of ``part``."""
        where = shard_slice(f"model.layers.{layer}.x.{part}.weight", self.config, self.tp)
        return self._shapes[part][1] if where is None or where[0] != 0 else where[2]

    def _shard(
        self, layer: int, part: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        where = shard_slice(f"model.layers.{layer}.x.{part}.weight", self.config, self.tp)
        if where is None:
            return a, b
        dim, start, length, _ = where
        if dim == 0:  # column-parallel: this rank's output rows of B
            return a, b[start : start + length]
        return a[:, start : start + length], b  # row-parallel: this rank's input columns
