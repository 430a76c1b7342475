"""``builtin:tiny``: a small random Llama, built deterministically and cached on disk.

The checkpoint is generated from a fixed seed with an explicit ``torch.Generator``,
written in Hugging Face format (``config.json`` + ``model.safetensors``, with the
byte-level BPE ``tokenizer.json`` and ``tokenizer_config.json`` of
:mod:`stages.model.builtin_tokenizer`) to
``$KVSTEP_CACHE_DIR`` (default ``~/.cache/kvstep``) under ``builtin-tiny-<hash>``, and
then loaded through the normal loader like any other checkpoint. Creation is atomic
(write to a temporary directory, then rename), so concurrent processes never see a
half-written model; later calls reuse the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.errors import ModelLoadError
from pipeline.logger import get_logger
from stages.model.builtin_tokenizer import tokenizer_version, write_tokenizer
from stages.model.config import ModelConfig
from stages.model.model import CausalLM

__all__ = [
    "BUILTIN_MODELS",
    "TINY_CONFIG",
    "build_tiny_state_dict",
    "resolve_model_path",
    "tokenizer_dir",
]

log = get_logger()

BUILTIN_MODELS = ("builtin:tiny",)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

# Changing the seed, the stds or TINY_CONFIG changes the weights, hence the version hash;
# the tokenizer's own version (its text, settings and chat template) is part of it too.
_SEED = 20240601
_EMBED_STD = 1.0
_LINEAR_STD = 0.08
_INIT_SCHEME = "normal-v1"


def _version() -> str:
    spec = {"config": TINY_CONFIG, "seed": _SEED, "stds": [_EMBED_STD, _LINEAR_STD]}
    spec["tokenizer"] = tokenizer_version()
    raw = json.dumps({**spec, "scheme": _INIT_SCHEME}, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:12]


def build_tiny_state_dict() -> dict[str, torch.Tensor]:
    """The tiny model's weights (float32, CPU), identical on every call and machine."""
    config = ModelConfig.from_hf_dict(TINY_CONFIG, "builtin:tiny")
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_SEED)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            std = _EMBED_STD if name == "model.embed_tokens.weight" else _LINEAR_STD
            state[name] = torch.randn(shape, generator=gen) * std
    return state


def _cache_root() -> Path:
    env = os.environ.get("KVSTEP_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstep"


def _ensure_tiny(root: Path) -> Path:
    final = root / f"builtin-tiny-{_version()}"
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".builtin-tiny-", dir=root))
    try:
        (tmp / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2), encoding="utf-8")
        write_tokenizer(tmp)
        save_file(build_tiny_state_dict(), str(tmp / "model.safetensors"))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
            # Another process won the race; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("builtin_model_created", model="builtin:tiny", path=str(final))
    return final


def resolve_model_path(model: str) -> Path:
    """The checkpoint directory of ``model``: a local directory, or a builtin (built once).

    Raises:
        ModelLoadError: An unknown ``builtin:`` name or a path that is not a directory.

    May block on disk I/O (and build the builtin model the first time, about a second).
    Safe to call from several threads or processes at once.
    """
    if model.startswith("builtin:"):
        if model != "builtin:tiny":
            raise ModelLoadError(model, f"unknown builtin model; available: {BUILTIN_MODELS}")
        return _ensure_tiny(_cache_root())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(path, "no such model directory (expected config.json + *.safetensors)")
    return path


def tokenizer_dir(model: str) -> Path:
    """Where ``model``'s tokenizer files are: a builtin's directory (built once), or
    ``model`` itself as a path, unchecked (a remote-only path simply has no tokenizer here).
    """
    if model.startswith("builtin:"):
        return resolve_model_path(model)
    return Path(model).expanduser()
