"""The mixture-of-experts MLP of Mixtral (``block_sparse_moe``) and Qwen3-MoE (``mlp``),
with HF's names.

A router (``gate``, one logit per expert) scores each token; the softmax of the scores
(in float32) picks the ``num_experts_per_tok`` best experts, their weights renormalised
to sum to one (always for Mixtral; Qwen3-MoE's ``norm_topk_prob``), as transformers
computes them; each expert is a SwiGLU MLP (Mixtral's ``w1`` gate, ``w3`` up, ``w2``
down; Qwen3-MoE's ``gate_proj``, ``up_proj``, ``down_proj``) and the token's output is the
weighted sum of its experts' outputs.

Computed grouped by expert, not token by token: the (token, expert) pairs are sorted by
expert once, and each expert with tokens runs two GEMMs over all of its tokens (gate and
up as one, once :meth:`SparseMoE.pack` ran at load), its weighted result added into the
output rows (``index_add_``). Under tensor parallelism
each rank holds every expert's slice of the intermediate width (``w1``/``w3`` rows,
``w2`` columns), computes its partial sums for all tokens, and one all-reduce of the
block's output completes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.model.config import ModelConfig
from stages.model.parallel import TensorParallel

__all__ = ["EXPERT_NAMES", "Expert", "SparseMoE"]


#: Each checkpoint family's names of an expert's gate, up and down projections.
EXPERT_NAMES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}


class Expert(nn.Module):
    """One expert's SwiGLU MLP under its family's names (:data:`EXPERT_NAMES`).

    After :meth:`SparseMoE.pack`, ``w13`` holds gate over up as one matrix (their
    parameters are views of its halves: no second copy), so gate and up are one GEMM.
    """

    w13: torch.Tensor | None
    names: tuple[str, str, str]

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inter, bias=False))
        self.add_module(up, nn.Linear(hidden, inter, bias=False))
        self.add_module(down, nn.Linear(inter, hidden, bias=False))
        self.names = names
        self.w13 = None

    def parts(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The gate, up and down projections (plain ones: before a kernel repacked
        them)."""
        gate, up, down = (self._modules[n] for n in self.names)
        assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)
        assert isinstance(down, nn.Linear)
        return gate, up, down


class SparseMoE(nn.Module):
    """Top-k routed experts (see the module).

    Args:
        config: The model's config (``num_experts``, ``num_experts_per_tok``).
        tp: The tensor-parallel group; each expert holds ``expert_intermediate_size //
            tp.size`` of its intermediate width here.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        inter = config.expert_intermediate_size // tp.size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.tp = tp
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        names = EXPERT_NAMES[config.moe_style]
        self.experts = nn.ModuleList(Expert(hidden, inter, names) for _ in range(self.num_experts))
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack(self) -> None:
        """Stack the experts' weights: ``w13`` ``[experts, 2 * inter, hidden]`` (each
        expert's ``w1`` over its ``w3``) and ``w2`` ``[experts, hidden, inter]``; each
        expert's parameters become views of its slices (no second copy; the loaded
        tensors are freed), and gate and up are one GEMM. (Running every expert at once
        as two batched GEMMs over zero-padded groups was measured slower at decode: it
        reads every expert's weights, not only the routed ones': 841 vs 311 us per
        layer at one token, fp32, 8 experts of 704.) Call once the weights are loaded;
        assigning an expert's weights again undoes it."""
        experts = [e for e in self.experts if isinstance(e, Expert)]
        parts = [e.parts() for e in experts]
        w13 = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()])
                           for g, u, _ in parts])  # fmt: skip
        w2 = torch.stack([d.weight.detach() for _, _, d in parts])
        inter = w2.shape[-1]
        for i, (e, (gate, up, down)) in enumerate(zip(experts, parts, strict=True)):
            gate.weight = nn.Parameter(w13[i, :inter], requires_grad=False)
            up.weight = nn.Parameter(w13[i, inter:], requires_grad=False)
            down.weight = nn.Parameter(w2[i], requires_grad=False)
            e.w13 = w13[i]
        self._stacked = (w13, w2)

    def unstack(self) -> None:
        """Forget the stacked weights (the experts' projections were repacked: a kernel's
        ``gate_up`` module runs them)."""
        self._stacked = None
        for e in self.experts:
            assert isinstance(e, Expert)
            e.w13 = None

    def _packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stacked weights, while every expert's parameters are still their views."""
        stacked = self._stacked
        if stacked is None:
            return None
        first = self.experts[0]
        assert isinstance(first, Expert)
        if first.parts()[0].weight.data_ptr() != stacked[0].data_ptr():
            return None
        return stacked

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for ``x [T, hidden]``, plus ``residual`` when given."""
        scores = F.linear(x, self.gate.weight).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).reshape(-1)
        pairs = chosen.reshape(-1)
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
        stacked = self._packed()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            mine = order[start : start + count]
            start += count
            rows = mine // self.top_k
            h = x.index_select(0, rows)
            e = self.experts[expert]
            assert isinstance(e, Expert)
            kernel, down = e._modules.get("gate_up"), e._modules.get(e.names[2])
            if kernel is not None and down is not None:  # repacked by a kernel (oneDNN)
                gate, up = kernel(h).chunk(2, dim=-1)
                y = down(F.silu(gate).mul_(up))
                out.index_add_(0, rows, y * weights.index_select(0, mine)[:, None])
                continue
            gate_p, up_p, down_p = e.parts()
            if stacked is not None and e.w13 is not None:
                gate, up = F.linear(h, e.w13).chunk(2, dim=-1)
                y = F.linear(F.silu(gate).mul_(up), down_p.weight)
            else:
                y = F.linear(F.silu(F.linear(h, gate_p.weight)) * F.linear(h, up_p.weight),
                             down_p.weight)  # fmt: skip
            out.index_add_(0, rows, y * weights.index_select(0, mine)[:, None])
        if self.tp.sharded:
            out = self.tp.reduce(out)
        return out if residual is None else out.add_(residual)
