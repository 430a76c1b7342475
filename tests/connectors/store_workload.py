"""The small workload the store-security tests run through real engines."""

from __future__ import annotations

from pathlib import Path

from pipeline import EngineConfig, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [(7 * n + 3) % 251 + 1 for n in range(53)],
    [(7 * n + 3) % 251 + 1 for n in range(40)] + [9, 8, 7],
    [(5 * n + 1) % 241 + 1 for n in range(40)],
]


def engine_config(
    model: Path, connector: str | None, options: dict, dtype: str = "float32"
) -> EngineConfig:
    """An engine on ``model`` without prefix caching (every hit is the store's)."""
    return EngineConfig(
        model=str(model),
        dtype=dtype,
        max_model_len=256,
        enable_prefix_caching=False,
        connector=connector,
        connector_options=options,
    )
