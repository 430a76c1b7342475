"""The model configuration kvstep needs, parsed from a Hugging Face ``config.json``.

Supported architectures are the Llama family: ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` (Qwen2's layout
without q/k/v biases, with each query and key head RMS-normed before the rotary
embedding) and ``Phi3ForCausalLM`` (Llama's layers, with q/k/v and gate/up stored as one
matrix each, split when loaded: :mod:`~stages.model.checkpoint`; its ``longrope`` scaling,
also spelled ``su`` or — Phi-3's alias — ``yarn``, as transformers' ``Phi3Config`` reads
it), and
``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` (a top-k routed mixture of SwiGLU
experts in place of the MLP, in every layer or in those Qwen3-MoE's
``decoder_sparse_step``/``mlp_only_layers`` say: :mod:`~stages.model.moe`), and Gemma 3's
text model ``Gemma3ForCausalLM`` (``model_type: gemma3_text``: sliding-window and full
layers, each kind with its own rotary embedding, Gemma's ``(1 + weight)`` RMSNorms
around both blocks, GeGLU, scaled embeddings: :mod:`~stages.model.gemma3`). Rotary
embeddings on part of a head (``partial_rotary_factor`` below 1) are refused. Both the
transformers 4 layout (``rope_theta`` + ``rope_scaling``; Gemma 3's
``rope_local_base_freq``) and the transformers 5 layout (``rope_parameters``, per layer
type for Gemma 3) of the rotary-embedding settings are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import ModelLoadError

__all__ = [
    "GEMMA3_ACTIVATIONS",
    "GEMMA3_ROPE_TYPES",
    "LAYER_TYPES",
    "ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "RopeConfig",
    "load_model_config",
]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")
"""Gemma 3's ``layer_types``: a layer attends to its whole context, or to its window."""
GEMMA3_ROPE_TYPES = ("default", "linear")
"""The rope types checked against transformers' Gemma 3 (per layer type); others refused."""
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
"""Gemma 3's ``hidden_activation`` values: GELU, tanh-approximated or exact."""

# Keys of a rope dict that are not scaling parameters.
_ROPE_META_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


@attrs.frozen(kw_only=True)
class RopeConfig:
    """Rotary-embedding settings.

    Attributes:
        rope_type: One of :data:`ROPE_TYPES`.
        theta: The base wavelength.
        params: The type's scaling parameters (``factor``, ``low_freq_factor``, ...), as a
            sorted tuple of ``(name, value)`` pairs so the class stays hashable.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        """The scaling parameter ``name``, or ``default`` when absent or ``None``."""
        for key, value in self.params:
            if key == name:
                return default if value is None else value
        return default

    @property
    def longrope_threshold(self) -> int | None:
        """``original_max_position_embeddings`` of a ``longrope`` rope, else ``None``.

        transformers picks longrope's frequencies per forward call: the long factors
        when the call's ``max(position_ids) + 1`` exceeds this, else the short ones
        (``generate``: the prefill by the prompt's length, each decode step by its
        position). kvstep decides per request and token the same way: position ``p``
        of a request with a prompt of ``n`` tokens rotates with the long factors when
        ``max(n, p + 1) > threshold`` (:class:`~stages.model.rope.LongRope`).
        """
        if self.rope_type != "longrope":
            return None
        return int(self.get("original_max_position_embeddings"))


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        architecture: The HF architecture name, one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: Rows of the embedding table.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention when fewer).
        head_dim: Width of one head.
        rms_norm_eps: Epsilon of every RMSNorm.
        rope: Rotary-embedding settings.
        max_position_embeddings: Context length the model was trained for.
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (always for Qwen2).
        o_proj_bias: The output projection carries a bias (Llama ``attention_bias``).
        mlp_bias: The MLP projections carry a bias (Llama ``mlp_bias``).
        num_experts: Experts of each mixture-of-experts block (0: plain MLPs only).
        num_experts_per_tok: Experts each token is routed to.
        moe_intermediate_size: Each expert's intermediate width (0: ``intermediate_size``).
        norm_topk_prob: The chosen experts' weights are renormalised to sum to one.
        moe_style: The experts' checkpoint names (``"mixtral"``: ``block_sparse_moe``
            with ``w1/w2/w3``; ``"qwen3_moe"``: ``mlp`` with ``gate/up/down_proj``).
        sparse_layers: The layers whose MLP is a mixture of experts.
        qk_norm: Each query and key head is RMS-normed over its width before the
            rotary embedding (Qwen3's ``q_norm``/``k_norm``).
        sliding_window: Sliding-window length, ``None`` when the model uses none. Only
            the layers ``layer_types`` marks ``sliding_attention`` apply it (a query at
            position ``p`` sees keys ``p - sliding_window < j <= p``); without
            ``layer_types`` (Mistral, Qwen2) it is refused below ``max_model_len``.
        layer_style: ``"llama"``: pre-norm residual blocks, RMSNorm ``x * w``, SwiGLU.
            ``"gemma3"``: Gemma's RMSNorm ``x * (1 + w)`` (in float32, cast after),
            before and after each block (input, post-attention, pre- and
            post-feedforward norms, the output normed before the residual add), a
            gated MLP of ``hidden_act``, embeddings scaled by ``sqrt(hidden_size)``.
        hidden_act: The gated MLP's activation: ``"silu"`` (SwiGLU) or one of
            :data:`GEMMA3_ACTIVATIONS` (GeGLU, Gemma 3 only).
        query_pre_attn_scalar: Softmax scale ``query_pre_attn_scalar ** -0.5`` (Gemma 3);
            ``None``: ``head_dim ** -0.5``.
        final_logit_softcapping: Logits become ``tanh(logits / cap) * cap``; ``None``:
            no cap.
        layer_types: Each layer's :data:`LAYER_TYPES` entry (Gemma 3); empty: every
            layer attends to its whole context.
        sliding_rope: The rotary embedding of the ``sliding_attention`` layers (``rope``
            is the full layers'); ``None``: ``rope`` for every layer.
        eos_token_ids: End-of-sequence token ids (``config.json`` may give one or a list).
        torch_dtype: The dtype the checkpoint was saved in, as a string, if stated.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = attrs.field(factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_style: str = ""
    sparse_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_style: str = "llama"
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_rope: RopeConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every layer's attention."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers that attend only to their last ``sliding_window`` positions."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention")

    @property
    def layer_pattern(self) -> str:
        """Which layers slide, as a string for the model fingerprint: ``"SSF:512"`` is two
        sliding layers then a full one, window 512; ``""`` when no layer slides (the KV a
        block holds depends on it: a block made under one pattern never loads into
        another)."""
        if not self.sliding_layers:
            return ""
        kinds = "".join("S" if kind == "sliding_attention" else "F" for kind in self.layer_types)
        return f"{kinds}:{self.sliding_window}"

    def prefix_cache_key(self, num_prompt_tokens: int) -> str | None:
        """What the block hashes of a request with ``num_prompt_tokens`` must also cover:
        ``"longrope:long"`` when a ``longrope`` model rotates its whole prompt with the
        long factors (its KV then differs from a short prompt's at the same positions,
        so the two never share cached blocks), else ``None``."""
        threshold = self.rope.longrope_threshold
        if threshold is not None and num_prompt_tokens > threshold:
            return "longrope:long"
        return None

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's intermediate width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence token id, or ``None``."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def check_max_model_len(self, max_model_len: int, path: object) -> None:
        """Refuse a ``max_model_len`` this implementation cannot serve exactly.

        Raises:
            ModelLoadError: The model uses a sliding window shorter than
                ``max_model_len`` in every layer (Mistral, Qwen2: sliding-window
                attention is implemented for the layers ``layer_types`` names only).
        """
        if self.sliding_layers:
            return
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ModelLoadError(
                path,
                f"sliding_window={self.sliding_window} < max_model_len={max_model_len} is "
                "unsupported (no sliding-window attention); use max_model_len <= "
                f"{self.sliding_window}",
            )

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], path: object = "<dict>") -> ModelConfig:
        """Parse a ``config.json`` dict.

        Raises:
            ModelLoadError: Unknown architecture, a missing required field, an
                unsupported rope type, or a setting the layers do not compute (an
                activation other than SiLU; for Gemma 3 those :func:`_gemma3` lists);
                the message names ``path`` and the field's value.
        """
        archs = data.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                path,
                f"unsupported architectures={archs!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        try:
            hidden = int(data["hidden_size"])
            heads = int(data["num_attention_heads"])
            fields: dict[str, Any] = {
                "vocab_size": int(data["vocab_size"]),
                "intermediate_size": int(data["intermediate_size"]),
                "num_hidden_layers": int(data["num_hidden_layers"]),
            }
        except KeyError as exc:
            raise ModelLoadError(
                path, f"config.json lacks required field {exc.args[0]!r}"
            ) from None
        gemma3 = arch == "Gemma3ForCausalLM"
        act = data.get("hidden_act", "silu")
        if not gemma3 and act != "silu":
            raise ModelLoadError(path, f"hidden_act={act!r} is unsupported (SwiGLU: silu)")
        head_dim = data.get("head_dim") or hidden // heads
        qwen2 = arch == "Qwen2ForCausalLM"
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        attention_bias = bool(data.get("attention_bias", False))
        sliding = data.get("sliding_window")
        if (qwen2 or qwen3) and not data.get("use_sliding_window", False):
            sliding = None
        eos = data.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        fields.update(
            architecture=arch,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or attention_bias,
            o_proj_bias=attention_bias and not qwen2,
            mlp_bias=bool(data.get("mlp_bias", False)),
            qk_norm=qwen3,
            sliding_window=None if sliding is None else int(sliding),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=data.get("torch_dtype") or data.get("dtype"),
        )
        if gemma3:
            fields.update(_gemma3(data, path))
        else:
            fields["rope"] = rope = _parse_rope(data, path)
            if rope.rope_type == "longrope":
                _check_longrope(rope, int(head_dim), path)
        return cls(**fields, **_experts(arch, data, path))


def _gemma3(data: dict[str, Any], path: object) -> dict[str, Any]:
    """The fields of a Gemma 3 text config, with transformers' ``Gemma3TextConfig``
    defaults; ``layer_types`` derived from ``sliding_window_pattern`` (default 6: every
    sixth layer full) when absent, as transformers derives it.

    Raises:
        ModelLoadError: A setting the layers do not compute: ``attn_logit_softcapping``
            (attention runs on ``scaled_dot_product_attention``, which cannot cap
            scores), ``use_bidirectional_attention``, an activation outside
            :data:`GEMMA3_ACTIVATIONS`, a rope type outside :data:`GEMMA3_ROPE_TYPES`,
            bad ``layer_types`` or a sliding window that is not a positive integer.
    """
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if data.get(name):
            raise ModelLoadError(path, f"{name}={data[name]!r} is unsupported (only null/false)")
    act = data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA3_ACTIVATIONS:
        raise ModelLoadError(
            path, f"hidden_activation={act!r} is unsupported; supported: "
            f"{', '.join(GEMMA3_ACTIVATIONS)}",
        )  # fmt: skip
    layers = int(data["num_hidden_layers"])
    kinds = data.get("layer_types")
    if kinds is None:
        pattern = int(data.get("sliding_window_pattern", 6))
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]  # fmt: skip
    if len(kinds) != layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ModelLoadError(
            path, f"layer_types={kinds!r} must give one of {', '.join(LAYER_TYPES)} for "
            f"each of the {layers} layers",
        )  # fmt: skip
    window = data.get("sliding_window", 4096)
    if "sliding_attention" not in kinds:
        window = None
    elif not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(path, f"sliding_window={window!r} must be a positive integer")
    full, local = _gemma3_ropes(data, path)
    cap = data.get("final_logit_softcapping")
    eos = data.get("eos_token_id", 1)
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return {
        "layer_style": "gemma3",
        "hidden_act": act,
        "num_key_value_heads": int(data.get("num_key_value_heads") or 4),
        "eos_token_ids": tuple(int(e) for e in eos_ids),
        "head_dim": int(data.get("head_dim") or 256),
        "max_position_embeddings": int(data.get("max_position_embeddings", 131_072)),
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "query_pre_attn_scalar": float(data.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": None if cap is None else float(cap),
        "layer_types": tuple(kinds),
        "sliding_window": window,
        "rope": full,
        "sliding_rope": local,
    }


def _gemma3_ropes(data: dict[str, Any], path: object) -> tuple[RopeConfig, RopeConfig]:
    """The full and sliding layers' rope settings, as ``Gemma3TextConfig`` reads them:
    ``rope_parameters`` per layer type, else ``rope_theta`` (default 1e6) and
    ``rope_scaling`` for the full layers and ``rope_local_base_freq`` (default 1e4) for
    the sliding ones."""
    params = data.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
        raise ModelLoadError(
            path, f"rope_parameters={params!r} must map {' and '.join(LAYER_TYPES)} to "
            "their rope settings",
        )  # fmt: skip
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(data.get("rope_scaling") or {})
    full.setdefault("rope_theta", data.get("rope_theta") or 1_000_000.0)
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", data.get("rope_local_base_freq") or 10_000.0)
    ropes = []
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        config = _rope_config(rope, data, path)
        if config.rope_type not in GEMMA3_ROPE_TYPES:
            raise ModelLoadError(
                path, f"rope_type={config.rope_type!r} of the {kind} layers is unsupported "
                f"for Gemma 3; supported: {', '.join(GEMMA3_ROPE_TYPES)}",
            )  # fmt: skip
        ropes.append(config)
    return ropes[0], ropes[1]


def _experts(arch: str, data: dict[str, Any], path: object) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config (none otherwise)."""
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    mixtral = arch == "MixtralForCausalLM"
    # Mixtral's configs say num_local_experts, Qwen3-MoE's num_experts (transformers 5
    # writes num_local_experts for both): either is read.
    key = next((k for k in ("num_local_experts", "num_experts") if k in data),
               "num_local_experts" if mixtral else "num_experts")  # fmt: skip
    experts, top_k = data.get(key), data.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ModelLoadError(
            path, f"{key}={experts!r} and num_experts_per_tok={top_k!r} must be "
            f"integers with 0 < num_experts_per_tok <= {key}",
        )  # fmt: skip
    layers = int(data["num_hidden_layers"])
    if mixtral:
        return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_style": "mixtral",
                "sparse_layers": tuple(range(layers))}  # fmt: skip
    step = int(data.get("decoder_sparse_step", 1) or 1)
    dense = set(data.get("mlp_only_layers") or ())
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_style": "qwen3_moe",
        "moe_intermediate_size": int(data.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(data.get("norm_topk_prob", False)),
        "sparse_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    }


def _parse_rope(data: dict[str, Any], path: object) -> RopeConfig:
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(path, f"rope settings {rope!r} must be a JSON object")
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise ModelLoadError(path, "per-layer-type rope parameters are unsupported")
    return _rope_config(rope, data, path)


def _rope_config(rope: dict[str, Any], data: dict[str, Any], path: object) -> RopeConfig:
    """The :class:`RopeConfig` of one rope settings object (``rope_theta`` falls back to
    the config's, then 10000).

    ``longrope`` (``su`` is its old name; Phi-3's ``yarn`` means it too, as
    ``Phi3Config`` maps it) takes ``original_max_position_embeddings`` from the config's
    top level when given there (transformers' ``standardize_rope_params`` prefers it; a
    Phi-3 config defaults it to 4096, as ``Phi3Config`` does), else from the rope
    settings, else ``max_position_embeddings``.
    """
    partial = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(
            path, f"partial_rotary_factor={partial!r} is unsupported (rotary on whole heads only)"
        )
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    phi3 = "Phi3ForCausalLM" in (data.get("architectures") or ())
    if rope_type == "su" or (phi3 and rope_type == "yarn"):
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            path, f"unsupported rope_type={rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = rope.get("rope_theta") or data.get("rope_theta") or 10000.0
    params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                          for k, v in rope.items() if k not in _ROPE_META_KEYS))  # fmt: skip
    if rope_type == "longrope":
        original = data.get("original_max_position_embeddings") or (
            4096 if phi3 else rope.get("original_max_position_embeddings")
        ) or data.get("max_position_embeddings", 4096)  # fmt: skip
        params = tuple(sorted((*((k, v) for k, v in params
                                  if k != "original_max_position_embeddings"),
                               ("original_max_position_embeddings", int(original)))))  # fmt: skip
        return RopeConfig(rope_type=rope_type, theta=float(theta), params=params)
    if rope_type != "default" and not any(k == "factor" for k, _ in params):
        raise ModelLoadError(path, f"rope_type={rope_type!r} needs a 'factor'")
    if rope_type in ("llama3", "yarn") and not any(
        k == "original_max_position_embeddings" for k, _ in params
    ):
        original = data.get("original_max_position_embeddings") or data.get(
            "max_position_embeddings", 4096
        )
        params = tuple(sorted((*params, ("original_max_position_embeddings", original))))
    return RopeConfig(rope_type=rope_type, theta=float(theta), params=params)


def _check_longrope(rope: RopeConfig, head_dim: int, path: object) -> None:
    """Refuse ``longrope`` settings without ``short_factor`` and ``long_factor`` lists of
    ``head_dim // 2`` numbers each (one per rotated frequency)."""
    for name in ("short_factor", "long_factor"):
        value = rope.get(name)
        if not (
            isinstance(value, tuple)
            and len(value) == head_dim // 2
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)
        ):
            raise ModelLoadError(
                path, f"rope_type='longrope' needs {name} as a list of head_dim // 2 = "
                f"{head_dim // 2} numbers; got {value!r}",
            )  # fmt: skip


def load_model_config(path: str | Path) -> ModelConfig:
    """Read and parse ``path/config.json``.

    Raises:
        ModelLoadError: ``path`` is not a directory, has no ``config.json``, the file is
            not valid JSON, or :meth:`ModelConfig.from_hf_dict` refuses it.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        what = "directory has no config.json" if directory.is_dir() else "no such directory"
        raise ModelLoadError(directory, what)
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(directory, f"config.json is unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(directory, "config.json must hold a JSON object")
    return ModelConfig.from_hf_dict(data, directory)
