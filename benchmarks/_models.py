"""The random Llama checkpoints the benchmarks build (not a benchmark itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_random_llama(path: Path, seed: int = 0, **config: Any) -> int:
    """Save a random-weight Llama with ``save_pretrained``; returns its parameter count."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def save_random_mixtral(path: Path, seed: int = 0, **config: Any) -> int:
    """Save a random-weight Mixtral (mixture of experts) with ``save_pretrained``; returns
    its parameter count."""
    import transformers

    torch.manual_seed(seed)
    config = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **config}
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())
