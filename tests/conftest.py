"""Shared fixtures: tiny random Hugging Face checkpoints and the engine leak check."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = {
    "llama": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        sliding_window=None,
    ),
    "qwen2": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
}


def build_checkpoint(kind: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight float32 ``kind`` checkpoint with ``save_pretrained``."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY[kind], **overrides})
    model = model_cls(config).to(torch.float32).eval()
    # Larger-than-default init so greedy tokens vary from position to position.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random checkpoint per supported architecture, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: build_checkpoint(kind, root / kind) for kind in TINY}


@pytest.fixture(scope="session")
def llama_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def assert_no_leaks(report: dict[str, int]) -> None:
    """The leak oracle: nothing in use, nothing pending, nothing bound."""
    leaks = {k: v for k, v in report.items() if k != "cached_blocks" and v}
    assert not leaks, f"leaked engine state: {leaks}"


@pytest.fixture
def leak_check() -> Callable[[dict[str, int]], None]:
    return assert_no_leaks


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """builtin:tiny caches under KVSTEP_CACHE_DIR; share one per session, off $HOME."""
    monkeypatch.setenv("KVSTEP_CACHE_DIR", str(_session_cache(tmp_path_factory)))


_CACHE: list[Path] = []


def _session_cache(factory: pytest.TempPathFactory) -> Path:
    if not _CACHE:
        _CACHE.append(factory.mktemp("kvstep-cache"))
    return _CACHE[0]


@pytest.fixture(autouse=True)
def _leak_oracle(monkeypatch: pytest.MonkeyPatch):
    """After every engine test: each engine closed in it had leaked nothing.

    ``AsyncEngine`` aborts whatever is still in flight before it closes its core, so at
    ``EngineCore.aclose`` every block must be free and nothing pending or bound.
    """
    from pipeline.engine import EngineCore

    reports: list[dict[str, int]] = []
    original = EngineCore.aclose

    async def checked_aclose(self: EngineCore) -> None:
        if not self._closed:
            reports.append(self.leak_report())
        await original(self)

    monkeypatch.setattr(EngineCore, "aclose", checked_aclose)
    yield
    for report in reports:
        assert_no_leaks(report)
