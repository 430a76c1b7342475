"""Multi-LoRA on the worker: a batch mixes base rows and rows of different adapters.

With ``enable_lora``, :func:`attach_lora` wraps each projection an adapter may target
(q/k/v/o, gate/up/down, or the packed ``qkv_proj``/``gate_up_proj`` they became) in a
:class:`LoRAProjection`: the base projection, then for each adapter of the step
``out[rows] += scaling * (x[rows] @ A^T) @ B^T`` on that adapter's rows only. The loop
runs over the step's adapters (at most ``max_loras``), never over tokens; rows of one
adapter that lie in one run of the batch are a view, others one gather. A row-parallel
projection (``o_proj``/``down_proj`` of a tensor-parallel shard) adds its update to its
partial product, before the all-reduce, with ``A`` split as the weight's input columns;
column-parallel ones split ``B`` as the weight's output rows.

:class:`LoRASlots` is a runner's ``max_loras`` slots, least recently used out first: an
adapter's weights are cast, scaled (``scaling`` folded into ``B``) and sharded once when
it takes a slot. The step's adapters and rows reach the projections through a context
variable set around the forward pass (:func:`lora_step`), so a model shared by
in-process ranks never holds one rank's step.
"""

from __future__ import annotations

import contextlib
import contextvars
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

__all__ = ["LoRAProjection", "LoRASlots", "LoRAStep", "attach_lora", "lora_step"]

_PARENTS = (("self_attn", ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_up_proj", "gate_proj", "up_proj", "down_proj")))  # fmt: skip

Rows = slice | torch.Tensor
"""A run of the batch's rows (a view), or their indices (a gather)."""


@attrs.frozen(eq=False)
class Delta:
    """One slot's update of one (possibly packed) projection: ``A`` of every part side
    by side, and per part ``(first output column, last + 1, first rank row, last + 1,
    B)`` (``B`` already multiplied by the adapter's scaling)."""

    a: torch.Tensor
    parts: tuple[tuple[int, int, int, int, torch.Tensor], ...]


@attrs.frozen(eq=False)
class LoRAStep:
    """The adapters of one forward pass: each slot's rows, and each slot's updates by
    ``(layer, projection name)``."""

    groups: tuple[tuple[Rows, dict[tuple[int, str], Delta]], ...]


_STEP: contextvars.ContextVar[LoRAStep | None] = contextvars.ContextVar(
    "kvstep_lora_step", default=None
)


class LoRAProjection(nn.Module):
    """A projection plus the low-rank updates of the step's adapters, on their rows.

    Args:
        base: The projection (``nn.Linear``, a packed oneDNN one, or a row-parallel one).
        key: ``(layer, name)`` of the projection in the slots' updates.
    """

    def __init__(self, base: nn.Module, key: tuple[int, str]) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self._row_parallel = isinstance(base, RowParallelLinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = _STEP.get()
        base = self.base
        if self._row_parallel:
            assert isinstance(base, RowParallelLinear)
            out = F.linear(x, base.weight)
        else:
            out = base(x)
        if step is not None:
            for rows, deltas in step.groups:
                delta = deltas.get(self.key)
                if delta is not None:
                    _add_update(out, x, rows, delta)
        if self._row_parallel:
            assert isinstance(base, RowParallelLinear)
            out = base.tp.reduce(out)
            if base.bias is not None:
                out += base.bias
        return out

    def extra_repr(self) -> str:
        return f"layer={self.key[0]}, {self.key[1]}"


def _add_update(out: torch.Tensor, x: torch.Tensor, rows: Rows, delta: Delta) -> None:
    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    h = xs @ delta.a.t()
    for c0, c1, r0, r1, b in delta.parts:
        d = h[:, r0:r1] @ b.t()
        if isinstance(rows, slice):
            out[rows, c0:c1] += d
        else:
            out[:, c0:c1].index_add_(0, rows, d)


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
    """A runner's adapters: ``max_loras`` slots, least recently used out first.

    Args:
        config: The base model's configuration (the adapters are checked against it).
        tp: How the model is sharded (the updates are split as the weights are).
        max_loras: Slots.
        max_rank: Largest rank accepted (``max_lora_rank``).
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
        self._slots: OrderedDict[str, dict[tuple[int, str], Delta]] = OrderedDict()
        self._fused: dict[str, str] = {}  # a packed part → the packed projection
        self._shapes = lora_shapes(config)

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
        groups = []
        for key, spans in runs.items():
            deltas = self._load(adapters[key], keep=runs.keys())
            rows: Rows
            if len(spans) == 1:
                rows = slice(*spans[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device)
            groups.append((rows, deltas))
        return LoRAStep(tuple(groups))

    def _load(self, adapter: LoRAAdapter, keep: Collection[str]) -> dict[tuple[int, str], Delta]:
        """``adapter``'s updates, from its slot or loaded into the least recently used
        slot whose adapter is not in ``keep`` (the step's)."""
        key = adapter.content_id
        deltas = self._slots.get(key)
        if deltas is not None:
            self._slots.move_to_end(key)
            return deltas
        weights = cached_adapter(adapter, self.config, max_rank=self.max_rank)
        while len(self._slots) >= self.max_loras:
            victim = next(k for k in self._slots if k not in keep)
            del self._slots[victim]
        deltas = self._deltas(weights.tensors, weights.targets, weights.scaling)
        self._slots[key] = deltas
        return deltas

    def _deltas(
        self,
        tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        targets: tuple[str, ...],
        scaling: float,
    ) -> dict[tuple[int, str], Delta]:
        """Each wrapped projection's update: its targeted parts' ``A`` stacked, ``B``
        scaled, both split as this rank's weight is, in the model's dtype."""
        grouped: dict[str, list[str]] = {}
        for target in targets:
            grouped.setdefault(self._fused.get(target, target), []).append(target)
        return {
            (layer, name): self._delta(
                tensors, layer, PACKED_TARGETS.get(name, (name,)), chosen, scaling
            )
            for layer in range(self.config.num_hidden_layers)
            for name, chosen in grouped.items()
        }

    def _delta(
        self,
        tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        layer: int,
        parts: tuple[str, ...],
        chosen: list[str],
        scaling: float,
    ) -> Delta:
        a_parts: list[torch.Tensor] = []
        pieces: list[tuple[int, int, int, int, torch.Tensor]] = []
        column = rank_row = 0
        for part in parts:
            width = self._width(layer, part)
            if part in chosen:
                a, b = tensors[layer, part]
                a, b = self._shard(layer, part, a, b)
                a_parts.append(a)
                b = (b * scaling).to(self.device, self.dtype)
                r = a.shape[0]
                pieces.append((column, column + width, rank_row, rank_row + r, b))
                rank_row += r
            column += width
        a_all = torch.cat(a_parts).to(self.device, self.dtype)
        return Delta(a_all, tuple(pieces))

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
