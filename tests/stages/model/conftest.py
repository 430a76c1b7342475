"""Fixtures of the forward-pass tests: tiny HF checkpoints and a hand-driven step loop."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import build_hf_model as _build

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams

_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}

# name -> (architecture, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("llama", {"tie_word_embeddings": False}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "llama_bias_head_dim": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 32, "num_key_value_heads": 1},
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": False, "use_sliding_window": False}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": False}),
    "qwen3": ("qwen3", {"tie_word_embeddings": False, "use_sliding_window": False, "head_dim": 32}),
    "qwen3_tied_bias": (
        "qwen3",
        {"tie_word_embeddings": True, "use_sliding_window": False, "attention_bias": True},
    ),
    "phi3": (
        "phi3",
        {
            "tie_word_embeddings": False,
            "sliding_window": None,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
        },
    ),
    "mixtral": (
        "mixtral",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": None,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
            "intermediate_size": 96,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "moe_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
            "norm_topk_prob": False,
            "use_sliding_window": False,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
        },
    ),
    "qwen3_moe_norm": (
        "qwen3_moe",
        {
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 3,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
            "use_sliding_window": False,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
        },
    ),
    # Sliding layers of window 8 around a full one, a rope per layer type (the full
    # layers' linear), a softmax scale of 24 ** -0.5 (not head_dim's), tied embeddings.
    "gemma3": (
        "gemma3",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        },
    ),
    # A window of one block (16) and full layers first, exact GELU, the final logits
    # soft-capped, lm_head untied.
    "gemma3_softcap": (
        "gemma3",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "sliding_window": 16,
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu",
            "final_logit_softcapping": 2.0,
            "tie_word_embeddings": False,
        },
    ),
    # Phi-3's longrope: the long factors from position 32 on (or for a prompt longer
    # than 32), eight distinct factors each (head_dim 16), the default attention factor
    # (max_position_embeddings / original = 4).
    "phi3_longrope": (
        "phi3",
        {
            "tie_word_embeddings": False,
            "sliding_window": None,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 32,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
                "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 13.0, 19.0],
            },
        },
    ),
    "rope_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "rope_llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "rope_yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "rope_dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
}


def build_hf_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """A random float32 transformers model on the forward tests' base config."""
    return _build(kind, seed, base=_BASE, **overrides)


@pytest.fixture(scope="session")
def hf_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Any, Path]]:
    """``get(variant) -> (hf_model, checkpoint_dir)``, each variant built once per session."""
    root = tmp_path_factory.mktemp("forward-checkpoints")
    cache: dict[str, tuple[Any, Path]] = {}

    def get(variant: str) -> tuple[Any, Path]:
        if variant not in cache:
            kind, overrides = VARIANTS[variant]
            model = build_hf_model(kind, **overrides)
            path = root / variant
            model.save_pretrained(path, safe_serialization=True)
            cache[variant] = (model, path)
        return cache[variant]

    return get


class StepDriver:
    """Plays the scheduler by hand: chunked prefill, block allocation, greedy decode.

    Each step gives every request either its next prefill chunk (at most ``chunk``
    tokens) or one decode token; blocks come from a shuffled free list, appended as the
    sequence grows, so block tables are not contiguous.
    """

    def __init__(self, runner: Any, *, chunk: int, seed: int = 0) -> None:
        self.runner = runner
        self.chunk = chunk
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.known: set[str] = set()
        self.params: dict[str, SamplingParams] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], params: SamplingParams | None = None) -> None:
        self.tokens[req_id] = list(prompt)
        self.prompt_len[req_id] = len(prompt)
        self.computed[req_id] = 0
        self.blocks[req_id] = []
        self.params[req_id] = params or SamplingParams(temperature=0.0, max_tokens=64)
        self.logits[req_id] = []

    def outputs(self, req_id: str) -> list[int]:
        return self.tokens[req_id][self.prompt_len[req_id] :]

    def step(self, active: list[str] | None = None) -> SchedulerOutput:
        """Schedule, execute and sample one step for ``active`` (default: all) requests."""
        requests = []
        for req_id in active if active is not None else list(self.tokens):
            toks, done = self.tokens[req_id], self.computed[req_id]
            n = min(self.chunk, len(toks) - done)
            need = -(-(done + n) // self.runner.block_size) - len(self.blocks[req_id])
            added = [self.free.pop() for _ in range(need)]
            self.blocks[req_id] += added
            new = req_id not in self.known
            self.known.add(req_id)
            requests.append(
                ScheduledRequest(
                    req_id=req_id,
                    token_ids=tuple(toks[done : done + n]),
                    num_computed_tokens=done,
                    block_ids=tuple(self.blocks[req_id]) if new else tuple(added),
                    new=new,
                    sampling=self.params[req_id],
                    sample=done + n == len(toks),
                    num_output_tokens=len(toks) - self.prompt_len[req_id],
                    num_prompt_tokens=self.prompt_len[req_id],
                )
            )
            self.computed[req_id] = done + n
        output = SchedulerOutput(step_id=self.step_id, requests=tuple(requests))
        self.step_id += 1
        model_output = self.runner.execute(output)
        sampled = self.runner.sample(output, model_output)
        for row, req_id in enumerate(model_output.req_ids):
            self.logits[req_id].append(model_output.logits[row].clone())
            self.tokens[req_id].extend(sampled.token_ids[req_id])
        return output

    def run(self, num_outputs: int) -> None:
        """Step until every request has ``num_outputs`` generated tokens."""
        while any(len(self.outputs(r)) < num_outputs for r in self.tokens):
            self.step([r for r in self.tokens if len(self.outputs(r)) < num_outputs])


@pytest.fixture(scope="session")
def step_driver() -> type[StepDriver]:
    """The :class:`StepDriver` class (fixtures are the portable way to share helpers)."""
    return StepDriver
