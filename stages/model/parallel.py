"""Megatron-style tensor parallelism: which rank holds which slice, and the all-reduce.

A tensor-parallel group of ``size`` ranks splits every decoder layer the Megatron way:
the q/k/v and MLP gate/up projections are split by output rows ("column-parallel": rank
``r`` owns query heads ``[r*h, (r+1)*h)`` with ``h = num_attention_heads // size``, the
matching KV heads and intermediate channels), ``o_proj`` and ``down_proj`` are split by
input columns ("row-parallel") and their partial sums are all-reduced, with the bias
added once after the reduce. Embeddings, norms and ``lm_head`` are replicated, so every
rank computes the full logits.

:class:`TensorParallel` is the value the model, loader, KV cache and runner are built
with; ``TensorParallel()`` is the unsharded single-rank default whose reduce is a no-op.
Every choice is made at construction: an unsharded model is built from plain
``nn.Linear`` layers and pays nothing for this module.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.checks import check_int
from pipeline.errors import InvalidConfigError
from stages.model.config import ModelConfig

__all__ = [
    "UNSHARDED",
    "RowParallelLinear",
    "TensorParallel",
    "check_tp_divisible",
    "destroy_process_group",
    "init_process_group",
    "kv_head_range",
    "row_parallel_linear",
    "shard_slice",
    "split_dim",
    "vocab_parallel",
]

# HF module names of the split projections (the last component before ``.weight``/``.bias``).
_COLUMN_SPLIT = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"})
_ROW_SPLIT = frozenset({"o_proj", "down_proj", "w2"})  # w1/w2/w3: Mixtral's experts


def _no_reduce(tensor: torch.Tensor) -> object:
    return None


def _no_gather(parts: list[torch.Tensor], tensor: torch.Tensor) -> object:
    parts[0].copy_(tensor)
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen
class TensorParallel:
    """This rank's place in a tensor-parallel group, and how to sum across it.

    Attributes:
        rank: This rank, in ``[0, size)``.
        size: Ranks in the group; 1 means unsharded.
        all_reduce: Sums a tensor across the group in place (its return value is
            ignored); a no-op by default. Not part of equality. Must be called by every
            rank in the same order (it is a collective): the model calls it twice per
            decoder layer in every forward pass, never conditionally.

    Raises:
        InvalidConfigError: ``size`` is not a positive integer (``world_size``), or
            ``rank`` is outside ``[0, size)``.
    """

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], object] = attrs.field(
        default=_no_reduce, eq=False, repr=False, kw_only=True
    )
    all_gather: Callable[[list[torch.Tensor], torch.Tensor], object] = attrs.field(
        default=_no_gather, eq=False, repr=False, kw_only=True
    )

    def __attrs_post_init__(self) -> None:
        check_int("world_size", self.size, InvalidConfigError, lo=1)
        if not _is_int(self.rank) or not 0 <= self.rank < self.size:
            raise InvalidConfigError("rank", self.rank, f"must be in [0, world_size={self.size})")

    @classmethod
    def from_process_group(cls) -> TensorParallel:
        """The group of the already initialised default ``torch.distributed`` process group.

        Rank and size come from ``torch.distributed``; the reduce is
        ``torch.distributed.all_reduce`` (sum).

        Raises:
            InvalidConfigError: ``torch.distributed`` is unavailable or not initialised.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidConfigError(
                "process_group",
                None,
                "torch.distributed must be initialised first (see init_process_group)",
            )
        return cls(
            rank=dist.get_rank(),
            size=dist.get_world_size(),
            all_reduce=dist.all_reduce,
            all_gather=dist.all_gather,
        )

    @property
    def sharded(self) -> bool:
        """Whether the model is split across more than one rank."""
        return self.size > 1

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` across the group in place and return it (``x`` itself when unsharded).

        A collective: blocks until every rank of the group has called it.
        """
        self.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along its last dimension, in rank order.

        A collective (every rank calls it with the same shape); ``x`` itself when
        unsharded.
        """
        if not self.sharded:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


UNSHARDED = TensorParallel()
"""The single-rank default (``TensorParallel()``): the whole model, a no-op reduce."""


def init_process_group(
    *, backend: str, init_method: str, rank: int, world_size: int, timeout_s: float
) -> TensorParallel:
    """Join the default ``torch.distributed`` group and return its :class:`TensorParallel`.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA; set this process's device first).
        init_method: Rendezvous URL, e.g. ``"tcp://127.0.0.1:29500"`` (rank 0 listens).
        rank: This process's rank.
        world_size: Processes in the group.
        timeout_s: Seconds the rendezvous and each collective may take.

    Raises:
        InvalidConfigError: ``timeout_s`` is not positive.
        RuntimeError: ``torch.distributed`` refuses (already initialised, rendezvous
            timed out, ...); it raises ``ValueError`` for an unknown backend.

    Blocks until every rank has joined (or the timeout passes); not cancellable.
    """
    import torch.distributed as dist

    if not timeout_s > 0:
        raise InvalidConfigError("timeout_s", timeout_s, "must be a positive number of seconds")
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallel.from_process_group()


def destroy_process_group() -> None:
    """Leave the default ``torch.distributed`` group; a no-op when none is initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_tp_divisible(config: ModelConfig, size: int) -> None:
    """Refuse a group size that does not split the model's heads and MLP evenly.

    ``size`` must divide ``num_attention_heads`` and ``intermediate_size``, and either
    divide ``num_key_value_heads`` or be a multiple of it (then each KV head is
    replicated on ``size // num_key_value_heads`` ranks, as grouped-query attention
    allows).

    Raises:
        InvalidConfigError: ``size`` is not a positive integer, or does not split one of
            those; the error names ``world_size``, its value and the model field with
            its value.
    """
    check_int("world_size", size, InvalidConfigError, lo=1)
    for field in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
        value = getattr(config, field)
        if value % size:
            raise InvalidConfigError(
                "world_size", size, f"must divide {field}={value} of the model"
            )
    kv = config.num_key_value_heads
    if kv % size and size % kv:
        raise InvalidConfigError(
            "world_size",
            size,
            f"must divide num_key_value_heads={kv} of the model, or be a multiple of it",
        )


def kv_head_range(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """The model's KV heads ``[start, end)`` rank ``tp.rank`` holds.

    Split evenly when the size divides them; when the group is larger, each rank holds
    the one KV head its query heads attend to (shared with ``size // kv`` ranks).
    """
    kv = config.num_key_value_heads
    if kv >= tp.size:
        local = kv // tp.size
        return tp.rank * local, (tp.rank + 1) * local
    head = tp.rank * kv // tp.size
    return head, head + 1


def shard_slice(
    name: str, config: ModelConfig, tp: TensorParallel, *, vocab_split: bool = False
) -> tuple[int, int, int, int] | None:
    """Where rank ``tp.rank``'s part of weight ``name`` lies: ``(dim, start, length,
    full)`` along its split dimension of ``full`` entries, or ``None`` when replicated."""
    if not tp.sharded:
        return None
    dim = split_dim(name, vocab_split=vocab_split)
    if dim is None:
        return None
    module = name.rpartition(".")[0].rpartition(".")[2]
    if module in ("k_proj", "v_proj"):
        start, end = kv_head_range(config, tp)
        full_kv = config.num_key_value_heads * config.head_dim
        return dim, start * config.head_dim, (end - start) * config.head_dim, full_kv
    inter = config.expert_intermediate_size if ".experts." in name else config.intermediate_size
    full = {
        "q_proj": config.num_attention_heads * config.head_dim,
        "o_proj": config.num_attention_heads * config.head_dim,
        "gate_proj": inter,
        "up_proj": inter,
        "down_proj": inter,
        "w1": inter,
        "w2": inter,
        "w3": inter,
        "lm_head": config.vocab_size,
    }[module]
    length = full // tp.size
    return dim, tp.rank * length, length, full


def vocab_parallel(config: ModelConfig, tp: TensorParallel) -> bool:
    """Whether ``lm_head`` is split by vocabulary rows: sharded, and the size divides it.

    Each rank then computes the logits of its share of the vocabulary and the ranks
    gather them (``lm_head`` is a large share of a decode step's work; computing it whole
    on every rank would cost each rank as much as the unsharded model does). A
    vocabulary the size does not divide keeps ``lm_head`` replicated.
    """
    return tp.sharded and config.vocab_size % tp.size == 0


def split_dim(name: str, *, vocab_split: bool = False) -> int | None:
    """The dimension along which a sharded model splits parameter ``name`` (HF naming).

    0 for the weights and biases of q/k/v/gate/up (column-parallel) and, with
    ``vocab_split``, for an untied ``lm_head.weight``; 1 for the weights of
    o_proj/down_proj (row-parallel); ``None`` for replicated ones (their biases included).
    """
    if name == "lm_head.weight":
        return 0 if vocab_split else None
    owner, _, attr = name.rpartition(".")
    module = owner.rpartition(".")[2]
    if module in _COLUMN_SPLIT:
        return 0
    if module in _ROW_SPLIT and attr == "weight":
        return 1
    return None


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of the input features; sums partials across ranks.

    ``forward`` computes the local partial product, all-reduces it, then adds the
    (replicated, full) bias exactly once. Parameter names are those of ``nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.reduce(F.linear(x, self.weight))
        if self.bias is not None:
            out += self.bias
        return out


def row_parallel_linear(
    in_features: int, out_features: int, *, bias: bool, tp: TensorParallel
) -> nn.Linear:
    """A plain ``nn.Linear`` when unsharded, else a :class:`RowParallelLinear`.

    ``in_features`` is this rank's (already divided) share.
    """
    if not tp.sharded:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias=bias, tp=tp)
