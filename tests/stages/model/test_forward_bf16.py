"""bfloat16 end to end on CPU: greedy tokens equal transformers' bfloat16 ``generate``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import LLM, EngineConfig, SamplingParams
from stages.model.attention import build_attention_metadata

NEW_TOKENS = 16
PROMPT_LENS = (1, 7, 33, 300)
BATCH = 2

HFGet = Callable[[str], tuple[Any, Path]]


def _hf_greedy(path: Path, prompts: torch.Tensor) -> list[list[int]]:
    """transformers' bfloat16 greedy tokens, EOS not special (as ``ignore_eos``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    # min_new_tokens would mask EOS out of the logits; kvstep's ignore_eos keeps it.
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, prompts.shape[1] :].tolist()


def kvstep_greedy(path: Path, batches: list[torch.Tensor]) -> list[list[list[int]]]:
    """kvstep's bfloat16 greedy tokens of each equal-length batch (``ignore_eos``)."""
    config = EngineConfig(
        model=str(path), dtype="bfloat16", max_model_len=512, enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(config) as llm:
        return [[list(o.token_ids) for o in llm.generate(b.tolist(), params)] for b in batches]


class TestBfloat16MatchesTransformers:
    @pytest.mark.parametrize(
        "variant",
        [
            "llama_gqa",
            "llama_tied",
            "llama_bias_head_dim",
            "mistral",
            "qwen2",
            "qwen3",
            "rope_yarn",
            "gemma3",
            "gemma3_softcap",
        ],
    )
    def test_greedy_tokens_equal(self, hf_checkpoint: HFGet, variant: str) -> None:
        """Equal-length batches: kvstep's bfloat16 greedy tokens are transformers'."""
        _, path = hf_checkpoint(variant)
        gen = torch.Generator().manual_seed(3)
        batches = [torch.randint(1, 256, (BATCH, n), generator=gen) for n in PROMPT_LENS]
        assert kvstep_greedy(path, batches) == [_hf_greedy(path, b) for b in batches]

    def test_kv_cache_and_logits_dtypes(self, hf_checkpoint: HFGet) -> None:
        """The KV cache and the weights are bfloat16; logits reach the sampler as float32."""
        from stages.model import ModelRunner

        _, path = hf_checkpoint("llama_gqa")
        runner = ModelRunner.load(
            str(path), dtype="bfloat16", device="cpu", num_blocks=8, max_model_len=64
        )
        try:
            assert {t.dtype for t in runner.kv_caches} == {torch.bfloat16}
            head = runner.model.lm_head  # its weight, or its prepacked weight (oneDNN)
            assert {t.dtype for t in [*head.parameters(), *head.buffers()]} == {torch.bfloat16}
            hidden = torch.zeros(1, runner.model_config.hidden_size, dtype=torch.bfloat16)
            assert runner.model.compute_logits(hidden).dtype == torch.float32
        finally:
            runner.close()


class TestExactLengthDecode:
    def test_equal_lengths_slice_keys_without_mask(self) -> None:
        """Decode requests of one context length attend to exactly that many keys."""
        meta = build_attention_metadata(
            query_lens=[1, 1],
            context_lens=[20, 20],
            block_tables=[[0, 1], [2, 3]],
            block_size=16,
            device=torch.device("cpu"),
        )
        assert meta.decode is not None
        assert meta.decode.seq_len == 21 and meta.decode.mask is None

    def test_mixed_lengths_keep_the_padding_mask(self) -> None:
        """Different context lengths fall back to padded keys and a mask."""
        meta = build_attention_metadata(
            query_lens=[1, 1],
            context_lens=[20, 3],
            block_tables=[[0, 1], [2]],
            block_size=16,
            device=torch.device("cpu"),
        )
        assert meta.decode is not None
        assert meta.decode.seq_len is None and meta.decode.mask is not None
        assert meta.decode.mask.shape == (2, 1, 1, 32)
