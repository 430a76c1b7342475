"""The kernel a CPU model's linear layers run on, chosen by timing them on this machine.

The right GEMM for a CPU depends on the CPU (issue 27's measurements): on an AMD Zen 3
(AVX2) torch's ``F.linear`` (MKL) was the fastest; on AVX-512 machines oneDNN with the
weight prepacked into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, what inductor's CPU freezing and vLLM-CPU use) beats it for large
row counts, and in bf16 on a CPU with AMX it is the fastest at every row count (batch-1
``F.linear`` in bf16 is slower than fp32 there). So nothing is assumed: at load,
:func:`choose_kernel` times each candidate on the model's own projection shapes at one
row (a batch-1 decode step), 8 rows (a batched decode step) and 256 rows (a prefill
chunk), and :func:`apply_kernel` puts the decoder's projections on the candidate with
the least time per token summed over the three. Per token, not per call: a sum of call
times is all prefill (a 256-row call takes ~40x a 1-row one), and picked oneDNN for
fp32 on a 2-core AMX Xeon, 10% faster there at 256 rows but 2.2x slower at one row,
which made batch-1 decode 1.45x slower in the engine (103-128 vs 155-169 tok/s on a
32M Llama; prefill equal).

Candidates (:data:`KERNELS`):

- ``"mkl"``: ``F.linear`` on the checkpoint's weight, as loaded (always available);
- ``"onednn"``: the weight prepacked once by oneDNN (the packed copy replaces the
  loaded one: no second copy is kept), on a CPU whose torch has oneDNN. The projections
  that read one input are packed as one GEMM, as vLLM's ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear`` do: ``q/k/v`` as the attention's ``qkv_proj`` and
  ``gate/up`` as the MLP's ``gate_up_proj`` (:class:`FusedPackedLinear`; the original
  names stay, as :class:`PackedPart` views of it). A decode row pays one call's fixed
  cost instead of three or two: on a 2-core Xeon (AMX), bf16, hidden 512, one row,
  q/k/v 59 -> 25 us and gate/up 61 -> 46 us.

``KVSTEP_LINEAR_KERNEL`` (``auto``, the default, or a kernel's name) forces the choice,
for tests and for measuring; a forced kernel this machine lacks is an
:class:`~pipeline.errors.InvalidConfigError`. Only CPU models are touched, and only the
decoder layers' plain projections (``q/k/v/o`` and ``gate/up/down``; a row-parallel
projection, which all-reduces, stays as it is) and an untied ``lm_head`` (a tied one is
the embedding matrix: packing it would keep a second copy). On an AMD EPYC (AVX512-BF16,
2 cores) an 8192x512 head at one row took 211 us in bf16 and 586 us in fp32 on
``F.linear``, 78 and 146 us prepacked.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import InvalidConfigError
from stages.model.moe import Expert, SparseMoE

__all__ = [
    "ENV",
    "KERNELS",
    "TIMED_ROWS",
    "FusedPackedLinear",
    "KernelChoice",
    "PackedLinear",
    "PackedPart",
    "apply_kernel",
    "available_kernels",
    "choose_kernel",
    "requested_kernel",
]

#: The environment variable that forces a kernel (``auto``: time them).
ENV: Final = "KVSTEP_LINEAR_KERNEL"
#: Every candidate, in order of preference on a tie.
KERNELS: Final = ("mkl", "onednn")
#: Rows of the prefill-sized timing (a chunk of a long prompt).
PREFILL_ROWS: Final = 256
#: Rows of each timing: batch-1 decode, batched decode, a prefill chunk.
TIMED_ROWS: Final = (1, 8, PREFILL_ROWS)
_REPEATS = 5


def _onednn_ops() -> bool:
    ops = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a linear layer in ``dtype`` on this CPU, tried on an
    8x8 weight. Its bfloat16 path needs AVX512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only
    CPU (or one whose oneDNN is capped below them by ``ONEDNN_MAX_CPU_ISA``) torch raises
    at packing, so a bfloat16 model's load failed there while timing the candidates."""
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
            x = torch.zeros(1, 8, dtype=dtype)
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def available_kernels(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The candidates this torch offers on ``device`` for weights of ``dtype``: only
    ``"mkl"`` off the CPU, or where oneDNN cannot pack ``dtype`` (bfloat16 on an AVX2-only
    CPU)."""
    if device.type != "cpu" or not _onednn_ops() or not _onednn_packs(dtype):
        return ("mkl",)
    return KERNELS


def requested_kernel() -> str:
    """``$KVSTEP_LINEAR_KERNEL`` (``"auto"`` when unset).

    Raises:
        InvalidConfigError: A value that is not ``auto`` or a kernel's name.
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value != "auto" and value not in KERNELS:
        raise InvalidConfigError(ENV, value, f"must be auto or one of {', '.join(KERNELS)}")
    return value


class FusedPackedLinear(nn.Module):
    """Projections of one input run as one prepacked oneDNN GEMM: their weights (and
    biases) stacked by output features, packed once (no reference to the originals kept).

    Args:
        linears: The projections, in the order of their outputs in the result; the same
            ``in_features``, all with a bias or none.

    Attributes:
        sizes: Each projection's ``out_features``, in order (``torch.split`` sizes).
    """

    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        with torch.no_grad():
            weight = torch.cat([linear.weight.detach() for linear in linears])
            self.in_features = linears[0].in_features
            self.sizes = tuple(linear.out_features for linear in linears)
            self.out_features = sum(self.sizes)
            self.register_buffer(
                "packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False
            )
            biases = [linear.bias for linear in linears]
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every projection's output side by side: ``[..., sum(sizes)]``."""
        if torch.compiler.is_compiling():  # opaque to inductor (compiled_forward)
            fused: torch.Tensor = torch.ops.kvstep.onednn_linear(x, self.packed, self.bias)
            return fused
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, sizes={self.sizes}, onednn"


class PackedLinear(FusedPackedLinear):
    """A linear layer on oneDNN with its weight prepacked (``y = x W^T + b``): the
    one-projection case of :class:`FusedPackedLinear`.

    Args:
        linear: The layer to replace; its weight is packed once (the module keeps no
            reference to the original).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__([linear])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


class PackedPart(nn.Module):
    """One projection of a :class:`FusedPackedLinear`, under its original name.

    Called alone it runs the whole fused GEMM and returns its own columns (a view); the
    decoder layers call the fused module once for all its parts instead.
    """

    fused: FusedPackedLinear

    def __init__(self, fused: FusedPackedLinear, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the parent holds it once
        self.index = index
        self.start = sum(fused.sizes[:index])
        self.out_features = fused.sizes[index]
        self.in_features = fused.in_features

    @property
    def bias(self) -> torch.Tensor | None:
        """This projection's bias: its slice of the fused one (a view), or ``None``."""
        bias = self.fused.bias
        return None if bias is None else bias[self.start : self.start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fused(x)[..., self.start : self.start + self.out_features]
        return out

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused projection, out_features={self.out_features}"


#: The projections packed together, per parent: ``(fused name, part names)``.
FUSED_GROUPS: Final = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                       ("gate_up_proj", ("gate_proj", "up_proj")))  # fmt: skip


@attrs.frozen
class KernelChoice:
    """What :func:`choose_kernel` decided.

    Attributes:
        kernel: The kernel the projections run on.
        forced: Whether ``$KVSTEP_LINEAR_KERNEL`` named it (no timing then).
        seconds: Per candidate, its seconds per token over the model's projection
            shapes, summed over :data:`TIMED_ROWS` (empty when forced or alone).
        candidates: The kernels this machine has for the dtype
            (:func:`available_kernels`).
    """

    kernel: str
    forced: bool = False
    seconds: Mapping[str, float] = attrs.field(factory=dict)
    candidates: tuple[str, ...] = ()


def _parents(model: nn.Module) -> Iterable[nn.Module]:
    """The attention and MLP blocks of ``model``'s decoder layers (not a mixture of
    experts: its router and experts stay as loaded)."""
    layers = getattr(getattr(model, "model", model), "layers", ())
    for layer in layers:
        for parent in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            if parent is not None and not isinstance(parent, SparseMoE):
                yield parent


def _projections(model: nn.Module) -> Iterable[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, linear)`` for each plain ``nn.Linear`` of the decoder layers."""
    for parent in _parents(model):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, name, child


def _fusable(parent: nn.Module, names: Sequence[str]) -> list[nn.Linear] | None:
    """The plain projections ``names`` of ``parent`` when they can be one GEMM: all plain
    ``nn.Linear`` of one input width, all with a bias or none."""
    linears = [getattr(parent, name, None) for name in names]
    if not all(type(linear) is nn.Linear for linear in linears):
        return None
    plain = [linear for linear in linears if isinstance(linear, nn.Linear)]
    if len({(lin.in_features, lin.bias is None, lin.weight.dtype) for lin in plain}) != 1:
        return None
    return plain


def _fuse(parent: nn.Module) -> int:
    """Pack each group of :data:`FUSED_GROUPS` that ``parent`` has as one GEMM; the
    projections fused."""
    fused_count = 0
    for fused_name, names in FUSED_GROUPS:
        linears = _fusable(parent, names)
        if linears is None:
            continue
        fused = FusedPackedLinear(linears)
        parent.add_module(fused_name, fused)
        for index, name in enumerate(names):
            setattr(parent, name, PackedPart(fused, index))
        fused_count += len(names)
    return fused_count


def _best_of(fn: Callable[[], object]) -> float:
    fn()  # warm-up: first-call allocations, oneDNN primitive creation
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _time(kernel: str, shapes: Mapping[tuple[int, int], int], dtype: torch.dtype) -> float:
    total = 0.0
    with torch.inference_mode():
        for (out_f, in_f), count in shapes.items():
            linear = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
            packed = PackedLinear(linear) if kernel == "onednn" else None
            weight = linear.weight.detach()
            for rows in TIMED_ROWS:
                x = torch.randn(rows, in_f, dtype=dtype)
                if packed is not None:
                    took = _best_of(functools.partial(packed, x))
                else:
                    took = _best_of(functools.partial(F.linear, x, weight))
                total += count * took / rows  # per token
    return total


def choose_kernel(model: nn.Module, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The kernel for ``model``'s projections: forced by ``$KVSTEP_LINEAR_KERNEL``, else
    the candidate with the least time per token over the model's projection shapes (each
    shape weighted by how many projections have it), summed over :data:`TIMED_ROWS`.

    Raises:
        InvalidConfigError: A forced kernel this machine does not have (for ``dtype``).
    """
    available = available_kernels(device, dtype)
    wanted = requested_kernel()
    if wanted != "auto":
        if wanted not in available:
            name = str(dtype).removeprefix("torch.")
            raise InvalidConfigError(
                ENV, wanted, f"is not available here for {name}; available: {', '.join(available)}"
            )
        return KernelChoice(wanted, forced=True, candidates=available)
    if len(available) == 1:
        return KernelChoice(available[0], candidates=available)
    shapes: dict[tuple[int, int], int] = {}
    head = _untied_head(model)
    for linear in [*(linear for _, _, linear in _projections(model)), *([head] if head else [])]:
        key = (linear.out_features, linear.in_features)
        shapes[key] = shapes.get(key, 0) + 1
    if not shapes:
        return KernelChoice("mkl", candidates=available)
    seconds = {kernel: _time(kernel, shapes, dtype) for kernel in available}
    best = min(available, key=lambda kernel: seconds[kernel])  # ties: the earlier one
    seconds = {k: round(v, 6) for k, v in seconds.items()}
    return KernelChoice(best, seconds=seconds, candidates=available)


def apply_kernel(model: nn.Module, kernel: str) -> int:
    """Put ``model``'s decoder projections on ``kernel``; the number of projections changed.

    ``"mkl"`` changes nothing. ``"onednn"`` packs each attention's ``q/k/v`` and each
    MLP's ``gate/up`` as one :class:`FusedPackedLinear` (``qkv_proj``, ``gate_up_proj``;
    the original names become :class:`PackedPart` views) and replaces every other plain
    projection by a :class:`PackedLinear`, each expert of a mixture likewise (its gate/up
    as ``gate_up``), and an untied ``lm_head`` too; the loaded weights are released.
    Call before the first forward pass (the layers take their projections then).
    """
    if kernel == "mkl":
        return 0
    from stages.model.layers import forget_references

    changed = 0
    for parent in list(_parents(model)):
        changed += _fuse(parent)
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                changed += 1
    for moe in [m for m in model.modules() if isinstance(m, SparseMoE)]:
        changed += _pack_experts(moe)
    head = _untied_head(model)
    if head is not None:
        model.lm_head = PackedLinear(head)
        changed += 1
    forget_references(model)
    return changed


def _untied_head(model: nn.Module) -> nn.Linear | None:
    """``model.lm_head`` when it is a plain ``nn.Linear`` with its own weight (a tied one
    is the embedding matrix)."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or config is None or config.tie_word_embeddings:
        return None
    return head


def _pack_experts(moe: SparseMoE) -> int:
    """Each expert of ``moe`` on oneDNN: gate and up as one :class:`FusedPackedLinear`
    (``gate_up``; the original names become :class:`PackedPart` views), down as a
    :class:`PackedLinear`; the stacked weights are released. The router stays."""
    changed = 0
    for expert in moe.experts:
        assert isinstance(expert, Expert)
        gate, up, down = expert.parts()
        gate_name, up_name, down_name = expert.names
        fused = FusedPackedLinear([gate, up])
        expert.add_module("gate_up", fused)
        setattr(expert, gate_name, PackedPart(fused, 0))
        setattr(expert, up_name, PackedPart(fused, 1))
        setattr(expert, down_name, PackedLinear(down))
        changed += 3
    moe.unstack()
    return changed
