"""SparseMoE: top-k routing as transformers' Mixtral computes it, with and without its
stacked weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.model.config import ModelConfig
from stages.model.moe import SparseMoE
from stages.model.parallel import UNSHARDED

CONFIG = ModelConfig(architecture="MixtralForCausalLM", vocab_size=16, hidden_size=32,
                     intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, num_experts=6,
                     num_experts_per_tok=2, moe_style="mixtral",
                     sparse_layers=(0,))  # fmt: skip


def _moe(seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(CONFIG, UNSHARDED)
    for p in moe.parameters():
        p.data.normal_(0.0, 0.2)
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalised weights, weighted expert sum."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.linear(x[t], moe.gate.weight).softmax(-1)
        w, idx = probs.topk(CONFIG.num_experts_per_tok)
        w = w / w.sum()
        for weight, e in zip(w.tolist(), idx.tolist(), strict=True):
            ex = moe.experts[e]
            h = F.silu(F.linear(x[t], ex.w1.weight)) * F.linear(x[t], ex.w3.weight)
            out[t] += weight * F.linear(h, ex.w2.weight)
    return out


@pytest.mark.parametrize("tokens", [1, 3, 48, 200])
@pytest.mark.parametrize("packed", [False, True])
def test_equals_token_by_token(tokens: int, packed: bool) -> None:
    """From one token (some experts idle) to many."""
    moe = _moe()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    want = _reference(moe, x)
    if packed:
        moe.pack()
    with torch.inference_mode():
        got = moe(x)
        again = moe(x, residual=torch.ones_like(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, want + 1, rtol=1e-5, atol=1e-5)


def test_pack_keeps_one_copy_and_reassignment_unpacks() -> None:
    moe = _moe()
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    moe.pack()
    assert all(torch.equal(p, before[n]) for n, p in moe.named_parameters())
    stacked = moe._packed()
    assert stacked is not None
    first = moe.experts[0]
    assert first.w1.weight.data_ptr() == stacked[0].data_ptr()  # a view, not a copy
    first.w1.weight = torch.nn.Parameter(first.w1.weight.detach().clone())
    assert moe._packed() is None  # a reassigned weight is used as it is
    x = torch.randn(4, 32)
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), _reference(moe, x), rtol=1e-5, atol=1e-5)
