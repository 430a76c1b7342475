"""Gemma 3's decoder layer (``Gemma3ForCausalLM``, ``model_type: gemma3_text``).

It differs from :class:`~stages.model.layers.DecoderLayer` in its residual blocks: each
block's input *and* output are normed, the output before it is added to the residual
stream (four norms a layer: ``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), every norm is Gemma's
``x * (1 + weight)`` in float32 (:func:`~stages.model.layers.gemma_rms_norm`), and the MLP
is a GeGLU (:func:`~stages.model.layers.geglu`). The attention is the shared one, with
Gemma's q/k norms and softmax scale ``query_pre_attn_scalar ** -0.5``. Which layers slide
is the model's business (:class:`~stages.model.model.CausalLM` hands each layer its
metadata and rotary table); the layer itself does not know.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.model.attention import AttentionMetadata
from stages.model.config import ModelConfig
from stages.model.layers import (
    MLP,
    DecoderLayer,
    GemmaRMSNorm,
    LayerHooks,
    attend,
    geglu,
    gemma_rms_norm,
)
from stages.model.parallel import TensorParallel
from stages.model.rope import CosSin

__all__ = ["Gemma3DecoderLayer"]


class Gemma3DecoderLayer(DecoderLayer):
    """Attention and GeGLU blocks, each normed before and after, as transformers'
    ``Gemma3DecoderLayer``: ``x + post_norm(block(pre_norm(x)))``.

    Parameter names are transformers' (``self_attn.*``, ``mlp.*`` and the four norms).
    Under tensor parallelism the norms are replicated; the post-block norms see the
    all-reduced block outputs.
    """

    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__(config, layer, tp)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def _collect_refs(self) -> tuple[Any, ...]:
        mlp = self._modules["mlp"]
        assert isinstance(mlp, MLP) and mlp.approximate is not None
        norms = (self.input_layernorm, self.post_attention_layernorm,
                 self.pre_feedforward_layernorm, self.post_feedforward_layernorm)  # fmt: skip
        return (*(n.weight for n in norms), self.input_layernorm.eps, self.self_attn.refs(),
                mlp.refs(), mlp.approximate)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        rope: CosSin,
        meta: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,
        hooks: LayerHooks | None,
    ) -> torch.Tensor:
        in_w, post_attn_w, pre_ff_w, post_ff_w, eps, attn, mlp, approximate = self._refs()
        h = attend(attn, gemma_rms_norm(x, in_w, eps), rope, meta, kv_cache, hooks)
        x = gemma_rms_norm(h, post_attn_w, eps).add_(x)  # a fresh tensor: x + norm(h)
        h = geglu(mlp, gemma_rms_norm(x, pre_ff_w, eps), approximate)
        return gemma_rms_norm(h, post_ff_w, eps).add_(x)
