"""kvstep's forward pass against transformers on the same random checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.model import ModelRunner

PROMPT_LENS = (1, 7, 16, 33, 300)
NUM_DECODE = 4
ATOL = 1e-4

HFGet = Callable[[str], tuple[Any, Path]]


def _prompts(vocab: int, seed: int = 1) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"r{n}": torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS}


def _check_against_hf(
    hf_checkpoint: HFGet, step_driver: Any, variant: str, *, chunk: int, **options: Any
) -> ModelRunner:
    """Logits and greedy tokens of ``variant`` against transformers'; ``options``: more
    ``ModelRunner.load`` settings. Returns the (closed) runner."""
    hf_model, path = hf_checkpoint(variant)
    runner = ModelRunner.load(
        str(path), dtype="float32", device="cpu", block_size=16, num_blocks=64,
        max_model_len=512, **options,
    )  # fmt: skip
    driver = step_driver(runner, chunk=chunk)
    for req_id, prompt in _prompts(runner.model_config.vocab_size).items():
        driver.add(req_id, prompt)
    driver.run(NUM_DECODE + 1)
    for req_id, rows in driver.logits.items():
        tokens = driver.tokens[req_id][:-1]  # the last sampled token has no logits yet
        with torch.no_grad():
            ref = hf_model(torch.tensor([tokens])).logits[0].float()
        first = driver.prompt_len[req_id] - 1
        ours = torch.stack(rows)
        expected = ref[first : first + len(rows)]
        assert ours.shape == expected.shape
        err = (ours - expected).abs().max().item()
        assert err < ATOL, f"{variant}/{req_id}: max abs error {err}"
        # Greedy decode fed the argmax back, so the tokens follow HF's argmax too.
        assert driver.outputs(req_id)[: len(rows)] == expected.argmax(-1).tolist()
    runner.close()
    return runner


class TestLogitsMatchTransformers:
    @pytest.mark.parametrize(
        "variant",
        [
            "llama_gqa",
            "llama_tied",
            "llama_bias_head_dim",
            "mistral",
            "qwen2",
            "qwen2_tied",
            "qwen3",
            "qwen3_tied_bias",
            "phi3",
            "mixtral",
            "qwen3_moe",
            "qwen3_moe_norm",
            "gemma3",
            "gemma3_softcap",
        ],
    )
    def test_architectures(self, hf_checkpoint: HFGet, step_driver: Any, variant: str) -> None:
        """Chunked prefill + decode logits match HF within 1e-4 for each architecture."""
        _check_against_hf(hf_checkpoint, step_driver, variant, chunk=48)

    @pytest.mark.parametrize("variant", ["rope_linear", "rope_llama3", "rope_yarn", "rope_dynamic"])
    def test_rope_scaling(self, hf_checkpoint: HFGet, step_driver: Any, variant: str) -> None:
        """Each supported rope_scaling type gives HF's logits within 1e-4."""
        _check_against_hf(hf_checkpoint, step_driver, variant, chunk=64)

    def test_whole_prompt_in_one_chunk(self, hf_checkpoint: HFGet, step_driver: Any) -> None:
        """Unchunked prefill (every prompt in one step) matches HF too."""
        _check_against_hf(hf_checkpoint, step_driver, "llama_gqa", chunk=512)

    @pytest.mark.parametrize("variant", ["qwen2", "gemma3"])
    def test_tiny_chunks(self, hf_checkpoint: HFGet, step_driver: Any, variant: str) -> None:
        """Chunks not aligned to blocks (5 tokens) keep the cached context exact (for
        Gemma 3: chunks shorter than the window, each against cached context)."""
        _check_against_hf(hf_checkpoint, step_driver, variant, chunk=5)


class TestSlidingWindow:
    @pytest.mark.parametrize("prompt_len", [3, 8, 9, 40])
    def test_one_request_decodes_past_the_window(
        self, hf_checkpoint: HFGet, step_driver: Any, prompt_len: int
    ) -> None:
        """A request decoding alone (keys sliced to the window, no mask) across and
        beyond its window of 8 gives transformers' logits, from prompts shorter than,
        as long as and longer than the window."""
        hf_model, path = hf_checkpoint("gemma3")
        runner = ModelRunner.load(
            str(path), dtype="float32", device="cpu", block_size=4, num_blocks=32,
            max_model_len=64,
        )  # fmt: skip
        driver = step_driver(runner, chunk=16)
        driver.add("a", torch.randint(0, 256, (prompt_len,)).tolist())
        driver.run(12)
        tokens = driver.tokens["a"][:-1]
        with torch.no_grad():
            ref = hf_model(torch.tensor([tokens])).logits[0]
        expected = ref[prompt_len - 1 :]
        err = (torch.stack(driver.logits["a"]) - expected).abs().max().item()
        runner.close()
        assert err < ATOL, f"max abs error {err}"
