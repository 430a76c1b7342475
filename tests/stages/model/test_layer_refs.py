"""``DecoderLayer.forward`` reads its parameters through references it keeps: it computes
what its submodules compute, and never uses a parameter that was replaced.

Each test runs the layer twice over the same token on its own copy of a KV cache and
compares with the submodules called one by one (the layer's definition): once the
references are taken, then after new parameters are put in place in each way torch
offers (assignment, ``load_state_dict(assign=True)``, a dtype conversion that
overwrites parameters), and after an in-place change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from stages.model import ModelConfig, allocate_kv_caches, build_attention_metadata
from stages.model.layers import DecoderLayer
from stages.model.parallel import UNSHARDED
from stages.model.rope import RotaryEmbedding

CPU = torch.device("cpu")
CONFIG = ModelConfig(
    architecture="Qwen2ForCausalLM",  # q/k/v biases too
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
)


def _layer() -> DecoderLayer:
    torch.manual_seed(0)
    layer = DecoderLayer(CONFIG, 0, UNSHARDED)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.eval()


def _run(layer: DecoderLayer, composed: bool) -> torch.Tensor:
    """The layer over a 5-token prefill of a fixed input (a fresh cache each time)."""
    dtype = next(layer.parameters()).dtype
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, CONFIG.hidden_size, generator=gen).to(dtype)
    meta = build_attention_metadata(
        query_lens=[5], context_lens=[0], block_tables=[[1, 2]], block_size=4, device=CPU
    )
    rope = RotaryEmbedding(CONFIG, 16, CPU).cos_sin(meta.positions, dtype)
    (cache,) = allocate_kv_caches(CONFIG, num_blocks=4, block_size=4, dtype=dtype, device=CPU)
    with torch.inference_mode():
        if not composed:
            return layer.forward(x, rope, meta, cache, None)
        h = x + layer.self_attn(layer.input_layernorm(x), rope, meta, cache, None)
        return h + layer.mlp(layer.post_attention_layernorm(h))


def test_forward_is_the_submodules_composed() -> None:
    layer = _layer()
    assert torch.equal(_run(layer, composed=False), _run(layer, composed=True))


def _assign(layer: DecoderLayer) -> None:
    layer.self_attn.q_proj.weight = nn.Parameter(torch.randn_like(layer.self_attn.q_proj.weight))


def _assign_bias(layer: DecoderLayer) -> None:
    layer.self_attn.k_proj.bias = nn.Parameter(torch.randn_like(layer.self_attn.k_proj.bias))


def _load_assign(layer: DecoderLayer) -> None:
    state = {k: torch.randn_like(v) for k, v in layer.state_dict().items()}
    layer.load_state_dict(state, assign=True)


def _in_place(layer: DecoderLayer) -> None:
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(-2.0)


@contextlib.contextmanager
def _overwrite_on_conversion() -> Iterator[None]:
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)


CHANGES: dict[str, Callable[[DecoderLayer], object]] = {
    "assigned_weight": _assign,
    "assigned_bias": _assign_bias,
    "load_state_dict_assign": _load_assign,
    "in_place": _in_place,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changed_parameters_are_used(change: str) -> None:
    layer = _layer()
    before = _run(layer, composed=False)  # the references are taken here
    CHANGES[change](layer)
    after = _run(layer, composed=False)
    assert not torch.equal(after, before)
    assert torch.equal(after, _run(layer, composed=True))


def test_conversion_that_overwrites_parameters() -> None:
    """``.double()`` with torch's overwrite-on-conversion switch puts new parameters in
    place without assigning them: the layer's ``_apply`` drops its references."""
    layer = _layer()
    _run(layer, composed=False)
    old = layer.self_attn.v_proj.weight
    with _overwrite_on_conversion():
        layer.double()
    assert layer.self_attn.v_proj.weight is not old
    out = _run(layer, composed=False)
    assert out.dtype == torch.float64
    assert torch.equal(out, _run(layer, composed=True))
