"""The mixture-of-experts MLP of Mixtral (``block_sparse_moe``), with HF's names.

A router (``gate``, one logit per expert) scores each token; the softmax of the scores
(in float32) picks the ``num_experts_per_tok`` best experts, their weights renormalised
to sum to one (as transformers' ``MixtralSparseMoeBlock``); each expert is a SwiGLU MLP
(``w1`` gate, ``w3`` up, ``w2`` down) and the token's output is the weighted sum of its
experts' outputs.

Computed grouped by expert, not token by token: the (token, expert) pairs are sorted by
expert once, and each expert with tokens runs three GEMMs over all of its tokens, its
weighted result added into the output rows (``index_add_``). Under tensor parallelism
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

__all__ = ["SparseMoE"]


class _Expert(nn.Module):
    """One expert's SwiGLU MLP (Mixtral's names: ``w1`` gate, ``w3`` up, ``w2`` down)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)


class SparseMoE(nn.Module):
    """Top-k routed experts (see the module).

    Args:
        config: The model's config (``num_experts``, ``num_experts_per_tok``).
        tp: The tensor-parallel group; each expert holds ``intermediate_size //
            tp.size`` of its intermediate width here.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        inter = config.intermediate_size // tp.size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.tp = tp
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden, inter) for _ in range(self.num_experts))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for ``x [T, hidden]``, plus ``residual`` when given."""
        scores = F.linear(x, self.gate.weight).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).reshape(-1)
        pairs = chosen.reshape(-1)
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
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
            assert isinstance(e, _Expert)
            y = F.linear(F.silu(F.linear(h, e.w1.weight)) * F.linear(h, e.w3.weight), e.w2.weight)
            out.index_add_(0, rows, y * weights.index_select(0, mine)[:, None])
        if self.tp.sharded:
            out = self.tp.reduce(out)
        return out if residual is None else out.add_(residual)
