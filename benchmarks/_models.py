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
