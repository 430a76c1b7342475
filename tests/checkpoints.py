"""Tiny random Hugging Face checkpoints for the tests (transformers is the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What every tiny checkpoint shares; each architecture adds or overrides below.
_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024)  # fmt: skip
# Token ids inside the 256-token vocabulary (transformers' defaults for Phi-3 and
# Mixtral lie outside it).
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY = {
    "llama": dict(_SHAPE, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "mistral": dict(_SHAPE, sliding_window=None),
    "qwen3": dict(_SHAPE, head_dim=16, tie_word_embeddings=False, use_sliding_window=False),
    "phi3": dict(_SHAPE, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                 **_SPECIAL),
    "mixtral": dict(_SHAPE, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                    **_SPECIAL),
    "qwen3_moe": dict(_SHAPE, moe_intermediate_size=48, num_hidden_layers=3, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False,
                      use_sliding_window=False, **_SPECIAL),
    "qwen2": dict(_SHAPE, tie_word_embeddings=True, use_sliding_window=False),
    # Prompts longer than the window; a softmax scale that is not head_dim's; each layer
    # type with its own rope (the full layers' linearly scaled).
    "gemma3": dict(_SHAPE, num_hidden_layers=3, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=24,
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                          "rope_theta": 100_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}),
}  # fmt: skip


def build_checkpoint(kind: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight float32 ``kind`` checkpoint with ``save_pretrained``."""
    model = build_hf_model(kind, seed, base=TINY[kind], **overrides)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_hf_model(kind: str, seed: int = 0, *, base: dict[str, Any], **overrides: Any) -> Any:
    """A random float32 transformers model with weights large enough to matter.

    Norm weights are ``1 + 0.1 * randn``; Gemma's, which scale by ``1 + weight``, are
    ``0.1 * randn`` (the same scales).
    """
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model: Any = model_cls(config_cls(**{**base, **overrides})).to(torch.float32).eval()
    offset = 0.0 if kind == "gemma3" else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(offset + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model
