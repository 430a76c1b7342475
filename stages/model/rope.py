"""Rotary position embeddings: inverse frequencies per rope type and a cos/sin table.

The frequencies follow transformers' ``modeling_rope_utils`` exactly for ``default``,
``linear``, ``llama3`` and ``yarn`` (including yarn's attention scaling of cos/sin).
``dynamic`` (NTK) differs in one documented way: transformers rescales the base from
the length of the *current* forward call, which a paged KV cache cannot follow (cached
keys are already rotated). kvstep uses the unscaled frequencies when ``max_model_len``
fits in ``max_position_embeddings`` (identical to transformers there) and otherwise one
fixed base computed for ``max_model_len``, as vLLM does.

``longrope`` (Phi-3's ``su``) has two sets of frequencies, the base ones divided by
``short_factor`` or by ``long_factor``, and scales cos/sin by ``attention_factor``
(default ``sqrt(1 + log(factor) / log(original_max_position_embeddings))`` with
``factor = max_position_embeddings / original_max_position_embeddings`` unless given),
as transformers' ``_compute_longrope_parameters``. transformers picks a set per forward
call (long when ``max(position_ids) + 1 > original_max_position_embeddings``); a paged
engine picks per request and token (:class:`LongRope`), which gives the same rotation
for every token that ``generate`` computes. The table then holds both sets, the long
one after the short one (:attr:`RotaryEmbedding.long_rope`), and a token's row is its
position plus the offset when it rotates long; other rope types have one set, and a
token's row is its position.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from stages.model.config import ModelConfig, RopeConfig

__all__ = [
    "CosSin",
    "LongRope",
    "RopeFrequencies",
    "RotaryEmbedding",
    "apply_rotary",
    "compute_inv_freq",
]


class CosSin(NamedTuple):
    """Per-token rotation factors, each ``[T, 1, head_dim]`` in the activations' dtype."""

    cos: torch.Tensor
    sin: torch.Tensor


class LongRope(NamedTuple):
    """Where a ``longrope`` table's long rows are and when a token uses them.

    Position ``p`` of a request whose prompt has ``n`` tokens rotates with the long
    factors, at table row ``p + offset``, when ``max(n, p + 1) > threshold``: a long
    prompt is long in every token (transformers' one prefill call sees its whole
    length), a short one from the first position past ``threshold`` on (each decode
    step of ``generate`` sees ``p + 1``), and its earlier keys keep their short rotation
    in the cache, as in transformers' cache. The rule is the request's, never the
    batch's or the chunk's, so chunked prefill, batching and recomputation after a
    preemption rotate every token as ``generate`` alone would.
    """

    threshold: int
    offset: int

    def rows(self, positions: list[int], prompt_lens: list[int]) -> list[int]:
        """The table rows of tokens at ``positions`` of requests with ``prompt_lens``."""
        threshold, offset = self.threshold, self.offset
        return [p + offset if n > threshold or p >= threshold else p
                for p, n in zip(positions, prompt_lens, strict=True)]  # fmt: skip


class RopeFrequencies(NamedTuple):
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scaling."""

    inv_freq: torch.Tensor
    attention_scaling: float


def _base_inv_freq(base: float, dim: int, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (base**exponents)


def compute_inv_freq(
    config: ModelConfig,
    max_model_len: int,
    device: torch.device | None = None,
    rope: RopeConfig | None = None,
    *,
    long: bool = False,
) -> RopeFrequencies:
    """The inverse frequencies and attention scaling of ``rope`` (default:
    ``config.rope``; Gemma 3's sliding layers pass ``config.sliding_rope``); for
    ``longrope``, those of the long factors when ``long``, else of the short ones.

    Pure function; safe to call from any thread.
    """
    rope = rope or config.rope
    dim = config.head_dim
    base = rope.theta
    if rope.rope_type == "default":
        return RopeFrequencies(_base_inv_freq(base, dim, device), 1.0)
    if rope.rope_type == "longrope":
        return _longrope(rope, config, base=base, dim=dim, long=long, device=device)
    factor = float(rope.get("factor"))
    if rope.rope_type == "linear":
        return RopeFrequencies(_base_inv_freq(base, dim, device) / factor, 1.0)
    if rope.rope_type == "dynamic":
        seq_len = max(max_model_len, config.max_position_embeddings)
        scaled = (factor * seq_len / config.max_position_embeddings) - (factor - 1)
        return RopeFrequencies(_base_inv_freq(base * scaled ** (dim / (dim - 2)), dim, device), 1.0)
    if rope.rope_type == "llama3":
        return RopeFrequencies(_llama3(rope, base=base, dim=dim, device=device), 1.0)
    return _yarn(rope, base=base, dim=dim, factor=factor, device=device)


def _longrope(
    rope: RopeConfig,
    config: ModelConfig,
    *,
    base: float,
    dim: int,
    long: bool,
    device: torch.device | None,
) -> RopeFrequencies:
    get = rope.get
    original = int(get("original_max_position_embeddings"))
    factor = get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original)
        )  # fmt: skip
    ext = torch.tensor(get("long_factor" if long else "short_factor"), dtype=torch.float32,
                       device=device)  # fmt: skip
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return RopeFrequencies(1.0 / (ext * base**shape), float(attention_factor))


def _llama3(
    rope: RopeConfig, *, base: float, dim: int, device: torch.device | None
) -> torch.Tensor:
    get = rope.get
    inv_freq = _base_inv_freq(base, dim, device)
    factor = float(get("factor"))
    low_freq_factor = float(get("low_freq_factor", 1.0))
    high_freq_factor = float(get("high_freq_factor", 4.0))
    old_context_len = float(get("original_max_position_embeddings"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    rope: RopeConfig, *, base: float, dim: int, factor: float, device: torch.device | None
) -> RopeFrequencies:
    get = rope.get
    original = float(get("original_max_position_embeddings"))
    attention_factor = get("attention_factor")
    mscale, mscale_all_dim = get("mscale"), get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(get("beta_fast") or 32)
    beta_slow = float(get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = (1 - ramp).to(device=device)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return RopeFrequencies(inv_freq, float(attention_factor))


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table for positions ``[0, max_len)``, applied by lookup.

    Rotation is the "rotate half" (non-interleaved) layout of Hugging Face Llama. The
    table is a non-persistent float32 buffer; lookups cast to the activations' dtype.
    ``rope`` overrides ``config.rope`` (a Gemma 3 model has one table per layer type).
    A ``longrope`` table has ``2 * max_len`` rows, the short factors' then the long
    factors' (:attr:`long_rope`); otherwise ``long_rope`` is ``None`` and row ``p`` is
    position ``p``.
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    long_rope: LongRope | None

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        device: torch.device,
        rope: RopeConfig | None = None,
    ) -> None:
        super().__init__()
        threshold = (rope or config.rope).longrope_threshold
        sets = [compute_inv_freq(config, max_len, device=device, rope=rope)]
        if threshold is not None:
            sets.append(compute_inv_freq(config, max_len, device=device, rope=rope, long=True))
        positions = torch.arange(max_len, device=device, dtype=torch.float32)
        cos, sin = [], []
        for freqs in sets:
            angles = positions[:, None] * freqs.inv_freq[None, :].float()
            emb = torch.cat((angles, angles), dim=-1)
            cos.append(emb.cos() * freqs.attention_scaling)
            sin.append(emb.sin() * freqs.attention_scaling)
        self.register_buffer("cos_cache", torch.cat(cos), persistent=False)
        self.register_buffer("sin_cache", torch.cat(sin), persistent=False)
        self.max_len = max_len
        self.long_rope = None if threshold is None else LongRope(threshold, max_len)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        """The rotation factors of table rows ``positions [T]``: each a position below
        ``max_len``, plus ``max_len`` for a token that rotates with longrope's long
        factors (:attr:`long_rope`)."""
        cos = self.cos_cache.index_select(0, positions).to(dtype)[:, None, :]
        sin = self.sin_cache.index_select(0, positions).to(dtype)[:, None, :]
        return CosSin(cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by the per-token ``cos``/``sin`` ``[T, 1, head_dim]``.

    ``x * cos + rotate_half(x) * sin`` (transformers' form) eagerly, with two temporaries
    fewer. Compiled, the same products and sums per half, concatenated: inductor then
    writes the result in one parallel loop, where the negated, concatenated copy of
    ``x`` costs it four single-threaded ones first. The values are equal bit for bit
    (``a + (-b) * s`` rounds as ``a - b * s``; each product is rounded where eager
    rounds it, see :mod:`stages.model.compiled_forward`).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():
        first = x1 * cos[..., :half] - x2 * sin[..., :half]
        return torch.cat((first, x2 * cos[..., half:] + x1 * sin[..., half:]), dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))  # x * cos + rotated * sin, two temporaries fewer
