"""Reading a peft LoRA adapter directory, as hostile input.

:func:`read_adapter` reads ``adapter_config.json`` and ``adapter_model.safetensors``
(never a pickled ``adapter_model.bin``) and checks everything against the base model
before any tensor is used: the peft type (``LORA``), the rank (at most the engine's
``max_lora_rank``), ``lora_alpha``, the target modules (the projections of
:data:`~pipeline.lora.LORA_TARGETS` the model has; what kvstep cannot apply — DoRA,
biases, ``modules_to_save``, per-layer or per-module ranks, fused-projection targets —
is refused by name), the file's size (bounded by what those shapes need) and every
tensor's name, shape and dtype (floating point, finite), each targeted projection of
every layer present with both halves. The bytes that are parsed are the bytes that are
hashed, so :attr:`AdapterWeights.content_id` names exactly the weights in use; a worker
that reads the directory again compares it with the id the engine checked.

The engine reads an adapter off its event loop; the parsed weights stay in a small
process-wide cache keyed by content id (:func:`cached_adapter`), so an in-process worker
takes them from there instead of reading the files again.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from pipeline.errors import InvalidRequestError
from pipeline.lora import LORA_TARGETS, LoRAAdapter, LoRARequest
from stages.model.config import ModelConfig
from stages.model.linear_kernels import FUSED_GROUPS

__all__ = ["AdapterWeights", "cached_adapter", "lora_shapes", "read_adapter", "resolve_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20
_HEADER_SLACK = 1 << 20  # the safetensors header: names and offsets of every tensor
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Configuration fields that change what the weights do, refused unless at their default.
_REFUSED: Mapping[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, ()),
    "layers_to_transform": (None,),
    "layers_pattern": (None, ()),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
}
_CACHE_SIZE = 8
#: Projections a checkpoint stores packed (Phi-3) and peft targets as one; an adapter's
#: ``B`` of one is its parts' ``B`` stacked by output rows, with one ``A`` for all.
PACKED_TARGETS: Mapping[str, tuple[str, ...]] = dict(FUSED_GROUPS)


def lora_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection an adapter may target in
    ``config``'s layers (whole, unsharded). A mixture of experts has no single
    gate/up/down projection: only the attention's are targets there."""
    hidden, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, 0
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden)}  # fmt: skip
    if not config.sparse_layers:
        inter = config.intermediate_size
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                   "down_proj": (inter, hidden)}  # fmt: skip
    return shapes


def _file_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The projections an adapter file of ``config``'s model names: :func:`lora_shapes`,
    and for a checkpoint that stores q/k/v and gate/up packed (Phi-3) those packs, which
    is what peft targets there."""
    shapes = lora_shapes(config)
    if config.architecture == "Phi3ForCausalLM":
        for packed, parts in PACKED_TARGETS.items():
            shapes[packed] = (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
            for part in parts:
                del shapes[part]
    return shapes


@attrs.frozen(kw_only=True, eq=False)
class AdapterWeights:
    """A checked adapter's weights, float32 on the CPU.

    Attributes:
        content_id: Hex SHA-256 of the weights file and of the fields of the
            configuration that apply it.
        rank: ``r``.
        scaling: What ``B @ A`` is multiplied by (``lora_alpha / r``, or
            ``lora_alpha / sqrt(r)`` with rsLoRA).
        targets: The projections it changes, in :data:`~pipeline.lora.LORA_TARGETS`'
            order.
        tensors: ``(layer, projection)`` → ``(A [r, in], B [out, r])``.
    """

    content_id: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _bad(request: LoRARequest, reason: str) -> InvalidRequestError:
    return InvalidRequestError("lora_request", request.lora_path, f"{request.lora_name}: {reason}")


def _read_at_most(request: LoRARequest, path: Path, limit: int, too_large: str) -> bytes:
    """``path``'s bytes, never reading more than ``limit + 1`` of them; ``too_large`` is
    the reason given when it holds more than ``limit``."""
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise _bad(request, f"cannot read {path.name}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise _bad(request, too_large)
    return data


def _read_config(request: LoRARequest, directory: Path, max_rank: int) -> dict[str, Any]:
    too_large = f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes"
    raw = _read_at_most(request, directory / CONFIG_FILE, MAX_CONFIG_BYTES, too_large)
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad(request, f"{CONFIG_FILE} is not JSON") from None
    if not isinstance(config, dict):
        raise _bad(request, f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise _bad(request, f"peft_type={config.get('peft_type')!r}: only LORA adapters")
    r = config.get("r")
    if type(r) is not int or not 1 <= r <= max_rank:
        raise _bad(request, f"r={r!r}: must be an int in [1, max_lora_rank={max_rank}]")
    alpha = config.get("lora_alpha", 8)
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise _bad(request, f"lora_alpha={alpha!r}: must be a positive number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise _bad(request, f"use_rslora={config.get('use_rslora')!r}: must be a bool")
    for field, allowed in _REFUSED.items():
        value = config.get(field)
        if value not in allowed:
            raise _bad(request, f"{field}={value!r} is not supported")
    return config


def _targets(
    request: LoRARequest, config: Mapping[str, Any], allowed: Mapping[str, Any]
) -> tuple[str, ...]:
    """The projections ``config``'s ``target_modules`` names (a list, or a regular
    expression matched against each projection's name as peft does)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error:
            raise _bad(request, f"target_modules={targets!r} is not a valid regex") from None
        names = {n for n in allowed if pattern.fullmatch(n) or targets == n}
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        names = {t.rpartition(".")[2] for t in targets}
        unknown = sorted(names - set(allowed))
        if unknown:
            raise _bad(
                request,
                f"target_modules {unknown} cannot be applied: targets must be among "
                f"{', '.join(allowed)}",
            )
    else:
        raise _bad(request, f"target_modules={targets!r}: must be a list of names or a regex")
    chosen = tuple(n for n in allowed if n in names)
    if not chosen:
        raise _bad(request, f"target_modules={targets!r} names none of {', '.join(allowed)}")
    return chosen


def _read_weights(request: LoRARequest, directory: Path, limit: int) -> bytes:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / PICKLED_FILE).exists():
            raise _bad(request, f"{PICKLED_FILE} is a pickle; only {WEIGHTS_FILE} is loaded")
        raise _bad(request, f"no {WEIGHTS_FILE} in the directory")
    too_large = f"{WEIGHTS_FILE} is larger than the {limit} bytes its shapes need"
    return _read_at_most(request, path, limit, too_large)


def _parse(
    request: LoRARequest,
    data: bytes,
    targets: tuple[str, ...],
    shapes: Mapping[str, tuple[int, int]],
    num_layers: int,
    r: int,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        raw = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise _bad(request, f"{WEIGHTS_FILE} is not a safetensors file ({exc})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        match = _NAME.match(name)
        layer = int(match.group(1)) if match else -1
        if match is None or match.group(2) not in targets or not 0 <= layer < num_layers:
            raise _bad(request, f"unexpected tensor {name[:200]!r} for {num_layers} layers "
                                f"and targets {', '.join(targets)}")  # fmt: skip
        module, half = match.group(2), match.group(3)
        fan_in, fan_out = shapes[module]
        want = (r, fan_in) if half == "A" else (fan_out, r)
        if tuple(tensor.shape) != want or tensor.dtype not in _DTYPES:
            raise _bad(request, f"{name}: {tuple(tensor.shape)} {tensor.dtype}, expected "
                                f"{want} in float32, float16 or bfloat16")  # fmt: skip
        tensor = tensor.float()
        if not bool(torch.isfinite(tensor).all()):
            raise _bad(request, f"{name} holds a NaN or infinity")
        halves.setdefault((layer, module), {})[half] = tensor
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(num_layers):
        for module in targets:
            pair = halves.get((layer, module), {})
            if "A" not in pair or "B" not in pair:
                raise _bad(request, f"layer {layer} {module}: lora_A and lora_B are both needed")
            out[layer, module] = (pair["A"], pair["B"])
    return out


def _unpack(
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    shapes: Mapping[str, tuple[int, int]],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Packed targets' pairs as their parts' (the one ``A``, ``B``'s rows of each)."""
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in tensors.items():
        parts = PACKED_TARGETS.get(module)
        if parts is None:
            out[layer, module] = (a, b)
            continue
        pieces = b.split([shapes[p][1] for p in parts])
        out.update({(layer, p): (a, piece) for p, piece in zip(parts, pieces, strict=True)})
    return out


def read_adapter(request: LoRARequest, config: ModelConfig, *, max_rank: int) -> AdapterWeights:
    """Read and check ``request``'s adapter directory against the base model ``config``.

    Blocks (file reads, hashing, parsing): call it off the event loop.

    Raises:
        InvalidRequestError: Anything wrong with the directory (``lora_request``, the
            path, and what is wrong: never the files' contents).
    """
    directory = Path(request.lora_path)
    if not directory.is_dir():
        raise _bad(request, "is not a directory")
    cfg = _read_config(request, directory, max_rank)
    shapes = _file_shapes(config)
    named = _targets(request, cfg, shapes)
    r = cfg["r"]
    layers = config.num_hidden_layers
    need = sum(r * (shapes[t][0] + shapes[t][1]) * 4 for t in named) * layers
    data = _read_weights(request, directory, need + _HEADER_SLACK)
    tensors = _unpack(_parse(request, data, named, shapes, layers, r), lora_shapes(config))
    targets = tuple(t for t in LORA_TARGETS if any(m == t for _, m in tensors))
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    applied = json.dumps({"r": r, "lora_alpha": alpha, "use_rslora": rslora,
                          "targets": targets}, sort_keys=True).encode()  # fmt: skip
    digest = hashlib.sha256(data)
    digest.update(applied)
    return AdapterWeights(
        content_id=digest.hexdigest(),
        rank=r,
        scaling=alpha / (math.sqrt(r) if rslora else r),
        targets=targets,
        tensors=tensors,
    )


_cache: OrderedDict[str, AdapterWeights] = OrderedDict()
_cache_lock = threading.Lock()


def _remember(weights: AdapterWeights) -> None:
    with _cache_lock:
        _cache[weights.content_id] = weights
        _cache.move_to_end(weights.content_id)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)


def resolve_adapter(request: LoRARequest, config: ModelConfig, *, max_rank: int) -> LoRAAdapter:
    """Read and check ``request``'s adapter (:func:`read_adapter`), keep its weights in
    the process's cache, and return what the engine's requests carry. Blocks."""
    weights = read_adapter(request, config, max_rank=max_rank)
    _remember(weights)
    return LoRAAdapter(
        name=request.lora_name,
        int_id=request.lora_int_id,
        path=str(Path(request.lora_path).resolve()),
        content_id=weights.content_id,
        rank=weights.rank,
    )


def cached_adapter(adapter: LoRAAdapter, config: ModelConfig, *, max_rank: int) -> AdapterWeights:
    """``adapter``'s weights: from the process's cache, or read again from its directory
    (a worker process) and checked to be the very weights the engine checked.

    Raises:
        InvalidRequestError: The directory no longer holds those weights, or fails the
            checks.
    """
    with _cache_lock:
        weights = _cache.get(adapter.content_id)
        if weights is not None:
            _cache.move_to_end(adapter.content_id)
            return weights
    request = LoRARequest(adapter.name, adapter.int_id, adapter.path)
    weights = read_adapter(request, config, max_rank=max_rank)
    if weights.content_id != adapter.content_id:
        raise _bad(request, "its files changed since the engine checked them")
    _remember(weights)
    return weights
