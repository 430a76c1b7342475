"""A Llama-family causal LM whose parameter names match Hugging Face's.

``state_dict()`` keys are exactly those of transformers' ``LlamaForCausalLM`` /
``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``), so safetensors
checkpoints load without renaming. The forward pass takes a flat batch of tokens of
several requests (prefill chunks and decode tokens mixed) and a paged KV cache. Built with
a sharded :class:`~stages.model.parallel.TensorParallel`, each rank holds its slice of
the attention and MLP weights under the same names (see :mod:`stages.model.parallel`).
Gemma 3 (``config.layer_style == "gemma3"``) runs its own layers
(:mod:`stages.model.gemma3`), scales the embeddings by ``sqrt(hidden_size)`` and gives
each sliding layer the step's windowed metadata and its own rotary table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stages.model.attention import AttentionMetadata, sliding_window_metadata
from stages.model.config import ModelConfig
from stages.model.gemma3 import Gemma3DecoderLayer
from stages.model.layers import DecoderLayer, GemmaRMSNorm, LayerHooks, RMSNorm
from stages.model.parallel import (
    UNSHARDED,
    TensorParallel,
    check_tp_divisible,
    vocab_parallel,
)
from stages.model.rope import RotaryEmbedding

__all__ = ["CausalLM", "DecoderModel"]


class _CheckpointEmbedding(nn.Embedding):
    """``nn.Embedding`` without the random init: the loader assigns its weight.

    ``nn.Embedding`` fills its weight with ``normal_`` on construction; on the meta
    device that op runs ``torch._refs``, which imports ``torch._dynamo`` (over a second
    per process). Parameter names and shapes are those of ``nn.Embedding``.
    """

    def reset_parameters(self) -> None:
        """Leave the weight uninitialised (it is replaced from the checkpoint)."""


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        gemma3 = config.layer_style == "gemma3"
        self.embed_tokens = _CheckpointEmbedding(config.vocab_size, config.hidden_size)
        layer_class = Gemma3DecoderLayer if gemma3 else DecoderLayer
        self.layers = nn.ModuleList(
            layer_class(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = (GemmaRMSNorm if gemma3 else RMSNorm)(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus ``lm_head`` (tied to the embeddings when the config says so).

    Build it under ``torch.device("meta")`` and fill it with
    :func:`stages.model.checkpoint.load_model`; :meth:`init_rope` then creates the rotary
    table on the real device. The embeddings are not randomly initialised (every weight
    comes from the checkpoint). Not thread-safe: one forward at a time.

    With a sharded ``tp`` this is rank ``tp.rank``'s shard: every rank of the group must
    run :meth:`forward` and :meth:`compute_logits` on the same batch at the same time
    (each layer all-reduces twice; the logits are gathered once). Embeddings and norms
    are replicated; ``lm_head`` is split by vocabulary rows when the size divides the
    vocabulary (:func:`~stages.model.parallel.vocab_parallel`; a tied ``lm_head`` uses
    its rows of the embeddings), and every rank gets the full logits.

    Sliding-window layers (Gemma 3's ``sliding_attention``) attend through
    :func:`~stages.model.attention.sliding_window_metadata` of the step's metadata,
    derived once per forward pass (only when the model has such layers), and rotate
    with ``sliding_rotary``; they keep every block of their context.

    Raises:
        InvalidConfigError: ``tp.size`` does not divide the model's heads or MLP width.
    """

    rotary: RotaryEmbedding
    sliding_rotary: RotaryEmbedding

    def __init__(self, config: ModelConfig, tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        if tp.sharded:
            check_tp_divisible(config, tp.size)
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, tp)
        # Per layer, whether it slides; None when none does (the plain loop runs).
        sliding = config.sliding_layers
        self._sliding: tuple[bool, ...] | None = (
            tuple(i in sliding for i in range(config.num_hidden_layers)) if sliding else None
        )
        # sqrt(hidden_size) rounded to each dtype seen (Gemma 3), else None.
        self._embed_scales: dict[torch.dtype, float] | None = (
            {} if config.layer_style == "gemma3" else None
        )
        self.vocab_parallel = vocab_parallel(config, tp)
        shard = config.vocab_size // tp.size if self.vocab_parallel else config.vocab_size
        # The rows of a tied lm_head's (full) weight this rank computes, else None.
        self._vocab_rows: slice | None = None
        if config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
            if self.vocab_parallel:
                self._vocab_rows = slice(tp.rank * shard, (tp.rank + 1) * shard)
        else:
            self.lm_head = nn.Linear(config.hidden_size, shard, bias=False)

    def init_rope(self, max_len: int, device: torch.device) -> None:
        """Create the cos/sin table for positions ``[0, max_len)`` on ``device``."""
        self.rotary = RotaryEmbedding(self.config, max_len, device)
        if self._sliding is not None:
            rope = self.config.sliding_rope
            self.sliding_rotary = RotaryEmbedding(self.config, max_len, device, rope=rope)

    def tie_weights(self) -> None:
        """Re-point ``lm_head`` at the embeddings (after weights were assigned)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata | None,
        kv_caches: Sequence[torch.Tensor | None],
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Run every layer over the flat batch; returns the final-norm hidden ``[T, hidden]``.

        Args:
            input_ids: ``[T]`` token ids.
            positions: ``[T]`` rows of the rotary table: each token's position, plus
                ``rotary.long_rope.offset`` for a token that a ``longrope`` model rotates
                with its long factors (:class:`~stages.model.rope.LongRope`).
            attn_meta: The step's attention metadata; ``None`` in a pass of
                :class:`~stages.model.compiled_forward.CompiledForward` (with ``None``
                caches and hooks: its attention op reads the step's).
            kv_caches: One cache tensor per layer; the new K/V are written into them.
            hooks: Per-layer callbacks (connector waits and saves), or ``None``.

        Blocks the calling thread for the whole computation; call it off the event loop.
        """
        model = self.model
        h = F.embedding(input_ids, model.embed_tokens.weight)
        if self._embed_scales is not None:
            h.mul_(self._embed_scale(h.dtype))
        rope = self.rotary.cos_sin(positions, h.dtype)
        if self._sliding is None:
            for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
                h = layer.forward(h, rope, attn_meta, kv_cache, hooks)  # no hooks of its own
        else:
            assert self.config.sliding_window is not None and attn_meta is not None
            window_meta = sliding_window_metadata(attn_meta, self.config.sliding_window)
            window_rope = self.sliding_rotary.cos_sin(positions, h.dtype)
            for layer, kv_cache, slides in zip(model.layers, kv_caches, self._sliding,
                                               strict=True):  # fmt: skip
                if slides:
                    h = layer.forward(h, window_rope, window_meta, kv_cache, hooks)
                else:
                    h = layer.forward(h, rope, attn_meta, kv_cache, hooks)
        norm = model.norm
        return norm.function(h, norm.weight, norm.eps)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """``sqrt(hidden_size)`` rounded to ``dtype``, as transformers' Gemma 3 casts its
        scale to the embeddings' dtype before multiplying (``sqrt(3072)`` is 55.5 in
        bfloat16)."""
        assert self._embed_scales is not None
        scale = self._embed_scales.get(dtype)
        if scale is None:
            exact = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32)
            scale = self._embed_scales[dtype] = float(exact.to(dtype))
        return scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 for hidden rows ``[N, hidden]``.

        Vocab-parallel: a collective (every rank of the group calls it on the same rows).
        """
        head = self.lm_head
        if type(head) is not nn.Linear:  # an untied head on another kernel (linear_kernels)
            logits = head(hidden)
        else:
            weight = head.weight
            if self._vocab_rows is not None:
                weight = weight[self._vocab_rows]
            logits = F.linear(hidden, weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the weights' dtype, as transformers caps
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        return self.tp.gather_last(logits) if self.vocab_parallel else logits
