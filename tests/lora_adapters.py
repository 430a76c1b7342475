"""Random peft LoRA adapters over the tiny test checkpoints, and transformers + peft as
the oracle of their greedy tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The two adapters the issue asks for: one on q/v, one on o/down.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "od": dict(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"], use_rslora=True),
}


def build_adapter(base: Path, path: Path, seed: int = 1, **lora: Any) -> Path:
    """Save a random peft LoRA adapter of ``base`` (``LoraConfig(**lora)``) with weights
    large enough to change greedy tokens."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: Path, adapter: Path | None, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' (+ peft's, with ``adapter``) greedy continuation of ``prompt``:
    exactly ``n`` tokens."""
    import torch
    import transformers
    from peft import PeftModel

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]
