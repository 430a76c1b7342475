"""The building blocks of a Llama-family decoder layer, with Hugging Face parameter names.

Every module works on a flat batch ``[T, ...]`` of tokens from several requests; the
per-request structure lives in :class:`~stages.model.attention.AttentionMetadata`.
Built with a sharded :class:`~stages.model.parallel.TensorParallel`, attention and MLP
hold this rank's slice (see :mod:`stages.model.parallel`); parameter names stay HF's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from stages.model.attention import AttentionMetadata, paged_attention
from stages.model.config import ModelConfig
from stages.model.moe import SparseMoE
from stages.model.parallel import TensorParallel, row_parallel_linear
from stages.model.rope import CosSin, apply_rotary

__all__ = [
    "MLP",
    "Attention",
    "AttentionRefs",
    "DecoderLayer",
    "GELU_APPROXIMATIONS",
    "GemmaRMSNorm",
    "LayerHooks",
    "MLPRefs",
    "Projection",
    "QKNorm",
    "RMSNorm",
    "attend",
    "forget_references",
    "geglu",
    "gemma_rms_norm",
    "hooked_attention",
    "rms_norm",
    "swiglu",
]


class LayerHooks(Protocol):
    """Callbacks around each layer's attention, called on the forward thread.

    ``before_attention(i)`` runs before layer ``i`` reads its KV cache (a connector waits
    for that layer's load there); ``after_attention(i)`` runs once layer ``i``'s new K/V
    is in the cache and its attention is computed (a connector starts saving there).
    Both must be thread-safe and should not block longer than the I/O they wait for.
    """

    def before_attention(self, layer: int) -> None: ...

    def after_attention(self, layer: int) -> None: ...


_FUSED_RMS_NORM = getattr(torch, "_fused_rms_norm", None)
"""torch's one-call RMS norm (``x * rsqrt(mean(x²) + eps) * weight``, the same operations
in the same order as the composite below, bit for bit on float32): one dispatch where the
composite makes six, which is most of a norm's cost at decode's one row."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm of the last dimension, computed in float32, the weight
    applied in ``x``'s dtype (as Hugging Face Llama does)."""
    dtype = x.dtype
    fused = _FUSED_RMS_NORM
    if fused is not None and not torch.compiler.is_compiling():  # inductor fuses the composite
        if dtype == torch.float32 and weight.dtype == torch.float32:
            return fused(x, (x.shape[-1],), weight, eps)[0]
        h = fused(x, (x.shape[-1],), None, eps)[0]  # computed in float32, rounded once
    else:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != dtype:
        return weight * h.to(dtype)  # promotes, as the composite does
    return h.to(dtype).mul_(weight)  # a fresh tensor: weight * h without another temporary


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's root-mean-square norm: ``x`` normed and multiplied by ``1 + weight``, both
    in float32, then cast to ``x``'s dtype (as transformers' ``Gemma3RMSNorm``: the
    product is rounded once, where Llama's rounds the normed ``x`` first)."""
    return rms_norm(x.float(), weight.float() + 1.0, eps).to(x.dtype)


NormFunction = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``(x, weight, eps) -> normed x``: :func:`rms_norm` or :func:`gemma_rms_norm`."""


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Hugging Face Llama does.

    ``function`` is the norm it computes (the layers call it on the weight directly).
    """

    function: NormFunction = staticmethod(rms_norm)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x * (1 + weight)`` in float32 (:func:`gemma_rms_norm`); the
    stored weight is the offset from one."""

    function: NormFunction = staticmethod(gemma_rms_norm)


_ASSIGNMENTS = [0]
"""Parameters assigned to any module of this process so far (a parameter's
registration, which setting ``module.weight = Parameter(...)`` or
``load_state_dict(assign=True)`` does): a change tells each layer to take its
references again."""


def _count_assignment(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _ASSIGNMENTS[0] += 1


register_module_parameter_registration_hook(_count_assignment)


def forget_references(model: nn.Module) -> None:
    """Make each decoder layer of ``model`` take its references again at its next call
    (after its projections were replaced by other modules, which is not an assignment)."""
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            module._refs_cache = None


def assignments() -> int:
    """Parameters assigned in this process so far: what cached parameter references
    (a layer's, a captured graph's) compare to know they are still current."""
    return _ASSIGNMENTS[0]


Projection = tuple[torch.Tensor, torch.Tensor | None] | nn.Module
"""A plain ``nn.Linear``'s ``(weight, bias)``, or a linear module that must be called
(a row-parallel one all-reduces its output)."""


def _projection(module: nn.Module) -> Projection:
    return (module.weight, module.bias) if type(module) is nn.Linear else module


def _project(p: Projection, x: torch.Tensor) -> torch.Tensor:
    if type(p) is tuple:
        return F.linear(x, p[0], p[1])
    out: torch.Tensor = p(x)  # type: ignore[operator]
    return out


QKNorm = tuple[torch.Tensor, torch.Tensor, float, NormFunction]
"""The per-head query and key RMSNorm weights, their epsilon and the norm (Qwen3's
:func:`rms_norm`, Gemma 3's :func:`gemma_rms_norm`)."""

AttentionRefs = tuple[
    Projection, Projection | None, Projection | None, Projection, int, int, int, float, int,
    QKNorm | None,
]  # fmt: skip
"""q, k, v and o projections, heads, KV heads, head width, scale, layer index, and the
q/k norms (``None``: none). With q/k/v packed as one GEMM (``qkv_proj``,
:func:`~stages.model.linear_kernels.apply_kernel`) the first is that projection and k
and v are ``None``."""

MLPRefs = tuple[Projection, Projection | None, Projection]
"""gate, up and down projections; with gate/up packed as one GEMM (``gate_up_proj``) the
first is that projection and up is ``None``."""


def _onto(p: Projection, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + p(x)``, added into ``p(x)``'s own fresh output (the same sums: one
    large temporary fewer); ``p(x)`` without a residual."""
    out = _project(p, x)
    return out if residual is None else out.add_(residual)


def attend(
    refs: AttentionRefs,
    x: torch.Tensor,
    rope: CosSin,
    meta: AttentionMetadata | None,
    kv_cache: torch.Tensor | None,
    hooks: LayerHooks | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention of ``x [T, hidden]`` over the paged KV cache (its new K/V written),
    added to ``residual`` when one is given.

    ``meta`` ``None``: a pass of :class:`~stages.model.compiled_forward.CompiledForward`,
    whose attention op reads the step's metadata, cache and hooks itself (a graph takes
    none of them: their ints change every step)."""
    q_p, k_p, v_p, o_p, heads, kv_heads, head_dim, scale, layer, qk_norm = refs
    t = x.shape[0]
    if k_p is None or v_p is None:  # one GEMM for the three: its columns are q | k | v
        q_x, k_x, v_x = _project(q_p, x).split((heads * head_dim, kv_heads * head_dim,
                                               kv_heads * head_dim), -1)  # fmt: skip
    else:
        q_x, k_x, v_x = _project(q_p, x), _project(k_p, x), _project(v_p, x)
    q_h, k_h = q_x.view(t, heads, head_dim), k_x.view(t, kv_heads, head_dim)
    if qk_norm is not None:  # Qwen3, Gemma 3: each head normed over its width, then rotated
        q_w, k_w, eps, norm = qk_norm
        q_h, k_h = norm(q_h, q_w, eps), norm(k_h, k_w, eps)
    q = apply_rotary(q_h, *rope)
    k = apply_rotary(k_h, *rope)
    v = v_x.view(t, kv_heads, head_dim)
    if meta is None:  # compiled_forward's pass: the op runs the step's attention
        o = torch.ops.kvstep.paged_attention(q, k, v, layer, scale, torch.compiler.is_compiling())
    else:
        assert kv_cache is not None
        o = hooked_attention(q, k, v, kv_cache, meta, scale, layer, hooks)
    return _onto(o_p, o.view(t, heads * head_dim), residual)


def hooked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: int,
    hooks: LayerHooks | None,
) -> torch.Tensor:
    """Layer ``layer``'s :func:`~stages.model.attention.paged_attention` between its
    connector hooks (the load waited for before, the save started after)."""
    if hooks is not None:
        hooks.before_attention(layer)
    o = paged_attention(q, k, v, kv_cache, meta, scale, layer)
    if hooks is not None:
        hooks.after_attention(layer)
    return o


def swiglu(refs: MLPRefs, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``, added to ``residual`` when one is given.

    Eagerly, the SiLU and the product are computed in place, in the gate projection's
    fresh output: the same operations in the same order, without two ``[tokens,
    intermediate]`` temporaries that a prefill would allocate (and the kernel page in)
    again every layer. Compiled, out of place: inductor fuses both into one loop over
    the product's half (an in-place SiLU on half of the packed gate | up output costs
    it a masked pass over whole rows first; half the prefill's pointwise time).
    """
    gate_p, up_p, down_p = refs
    if up_p is None:  # one GEMM for both: its columns are gate | up
        gate, up = _project(gate_p, x).chunk(2, -1)
        if torch.compiler.is_compiling():
            h = F.silu(gate) * up
        else:
            h = torch.mul(F.silu(gate, inplace=True), up)  # contiguous, for the down projection
    else:
        h = F.silu(_project(gate_p, x), inplace=True).mul_(_project(up_p, x))
    return _onto(down_p, h, residual)


def geglu(refs: MLPRefs, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``down(gelu(gate(x)) * up(x))`` (Gemma's MLP; ``approximate``: ``"tanh"`` or
    ``"none"``, as ``F.gelu`` takes it)."""
    gate_p, up_p, down_p = refs
    if up_p is None:  # one GEMM for both: its columns are gate | up
        gate, up = _project(gate_p, x).chunk(2, -1)
        h = torch.mul(F.gelu(gate, approximate=approximate), up)
    else:
        h = F.gelu(_project(gate_p, x), approximate=approximate).mul_(_project(up_p, x))
    return _project(down_p, h)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache.

    ``num_heads`` and ``num_kv_heads`` are this rank's: the model's counts divided by
    ``tp.size`` (the caller checked divisibility). q/k/v are column-split by heads,
    ``o_proj`` is row-split and all-reduces its output.
    """

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp.size)  # >= 1: replicated
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        hidden, hd = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=bias)
        self.o_proj = row_parallel_linear(
            self.num_heads * hd, hidden, bias=config.o_proj_bias, tp=tp
        )
        if config.qk_norm:
            norm = GemmaRMSNorm if config.layer_style == "gemma3" else RMSNorm
            self.q_norm = norm(hd, config.rms_norm_eps)
            self.k_norm = norm(hd, config.rms_norm_eps)

    def refs(self) -> AttentionRefs:
        """The tensors and sizes :func:`attend` reads."""
        qkv = self._modules.get("qkv_proj")
        q, k, v = (
            (qkv, None, None)
            if qkv is not None
            else (_projection(self.q_proj), _projection(self.k_proj), _projection(self.v_proj))
        )
        q_norm, k_norm = self._modules.get("q_norm"), self._modules.get("k_norm")
        qk_norm = None
        if isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm):
            qk_norm = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.function)
        return (q, k, v, _projection(self.o_proj), self.num_heads, self.num_kv_heads,
                self.head_dim, self.scale, self.layer, qk_norm)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        rope: CosSin,
        meta: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,
        hooks: LayerHooks | None,
    ) -> torch.Tensor:
        return attend(self.refs(), x, rope, meta, kv_cache, hooks)


GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
"""``F.gelu``'s ``approximate`` of each GeGLU ``hidden_act`` (transformers' ``ACT2FN``)."""


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; GeGLU (:func:`geglu`) when the config's
    ``hidden_act`` is a GELU (Gemma 3).

    Sharded: gate/up hold ``intermediate_size // tp.size`` output channels, ``down_proj``
    the matching input columns and all-reduces its output.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.approximate = GELU_APPROXIMATIONS.get(config.hidden_act)  # None: SiLU
        hidden, bias = config.hidden_size, config.mlp_bias
        inter = config.intermediate_size // tp.size
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = row_parallel_linear(inter, hidden, bias=bias, tp=tp)

    def refs(self) -> MLPRefs:
        """The projections :func:`swiglu` (or :func:`geglu`) reads."""
        gate_up = self._modules.get("gate_up_proj")
        if gate_up is not None:
            return gate_up, None, _projection(self.down_proj)
        return _projection(self.gate_proj), _projection(self.up_proj), _projection(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate is not None:
            return geglu(self.refs(), x, self.approximate)
        return swiglu(self.refs(), x)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections.

    :meth:`forward` reads the layer's tensors from a tuple of references (to the
    parameters themselves, not copies), instead of calling eight submodules:
    ``nn.Module`` dispatch and attribute lookups cost more than a small decode step's
    matmuls. It runs the same functions as the submodules' own ``forward``
    (:func:`attend`, :func:`swiglu`, :func:`rms_norm`). The references
    are taken again after any parameter of the process was assigned
    (``module.weight = Parameter(...)``, ``load_state_dict(assign=True)``) and after
    ``.to()``-style conversions (:meth:`_apply`); in-place changes (``.data``,
    ``copy_``, ``load_state_dict``) reach them directly.
    """

    norm_class: type[RMSNorm] = RMSNorm
    """The class of the layer's norms (a subclass's may differ)."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        if layer not in config.sparse_layers:
            self.mlp = MLP(config, tp)
        elif config.moe_style == "mixtral":
            self.block_sparse_moe = SparseMoE(config, tp)
        else:
            self.add_module("mlp", SparseMoE(config, tp))
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self._refs_cache: tuple[int, tuple[Any, ...]] | None = None

    def _refs(self) -> tuple[Any, ...]:
        if torch.compiler.is_compiling():  # traced once: guards on the modules themselves
            return self._collect_refs()
        cache = self._refs_cache
        if cache is not None and cache[0] == _ASSIGNMENTS[0]:
            return cache[1]
        refs = self._collect_refs()
        self._refs_cache = (_ASSIGNMENTS[0], refs)
        return refs

    def _collect_refs(self) -> tuple[Any, ...]:
        """The references :meth:`forward` reads (taken again when stale)."""
        norm, post = self.input_layernorm, self.post_attention_layernorm
        mlp = self._modules.get("block_sparse_moe") or self._modules["mlp"]
        assert isinstance(mlp, (MLP, SparseMoE))
        return (norm.weight, norm.eps, self.self_attn.refs(), post.weight, post.eps,
                mlp if isinstance(mlp, SparseMoE) else mlp.refs())  # fmt: skip

    def _apply(self, fn: Any, recurse: bool = True) -> DecoderLayer:
        self._refs_cache = None  # a conversion may put new parameters in place
        return super()._apply(fn, recurse)

    def forward(
        self,
        x: torch.Tensor,
        rope: CosSin,
        meta: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,
        hooks: LayerHooks | None,
    ) -> torch.Tensor:
        norm_w, norm_eps, attn, post_w, post_eps, mlp = self._refs()
        x = attend(attn, rms_norm(x, norm_w, norm_eps), rope, meta, kv_cache, hooks, x)
        if isinstance(mlp, nn.Module):  # a mixture of experts
            out: torch.Tensor = mlp(rms_norm(x, post_w, post_eps), x)
            return out
        return swiglu(mlp, rms_norm(x, post_w, post_eps), x)
