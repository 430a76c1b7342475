"""Phi-3's ``longrope`` against transformers call by call: the long or short factors
chosen per request and token (a prompt longer than ``original_max_position_embeddings``
= 32 long in every token, a shorter one from position 32 on, its cached keys kept),
whatever the chunking and batching. (``Phi3ForCausalLM.generate`` differs at one point:
when a short sequence reaches position 32 it drops its cache and recomputes it with the
long factors; kvstep keeps the cache, as every other model's ``generate`` does.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.model import ModelRunner
from stages.model.rope import LongRope

VARIANT = "phi3_longrope"
THRESHOLD = 32
ATOL = 1e-4

HFGet = Callable[[str], tuple[Any, Path]]


def _generate(hf_model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of each, one forward call over the prompt, then one
    per token against the cache (``generate``'s calls, without Phi-3's cache reset)."""
    out = hf_model(torch.tensor([prompt]), use_cache=True)
    rows, tokens = [out.logits[0, -1]], []
    for _ in range(steps - 1):
        tokens.append(int(rows[-1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]]), cache=out.cache,
                       use_cache=True)  # fmt: skip
        rows.append(out.logits[0, -1])
    tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows).float()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(
    hf_checkpoint: HFGet, step_driver: Any, prompts: dict[str, int], *, chunk: int, steps: int
) -> None:
    hf_model, path = hf_checkpoint(VARIANT)
    runner = ModelRunner.load(
        str(path), dtype="float32", device="cpu", block_size=16, num_blocks=64, max_model_len=128
    )
    driver = step_driver(runner, chunk=chunk)
    for i, (req_id, n) in enumerate(prompts.items()):
        driver.add(req_id, _prompt(n, i))
    driver.run(steps)
    runner.close()
    for req_id, n in prompts.items():
        with torch.no_grad():
            tokens, expected = _generate(hf_model, driver.tokens[req_id][:n], steps)
        ours = torch.stack(driver.logits[req_id])
        err = (ours - expected).abs().max().item()
        assert err < ATOL, f"{req_id} (prompt {n}): max abs error {err}"
        assert driver.outputs(req_id) == tokens, req_id


class TestLongRopeMatchesTransformers:
    @pytest.mark.parametrize("chunk", [128, 16, 5])
    def test_short_and_long_prompts_in_one_batch(
        self, hf_checkpoint: HFGet, step_driver: Any, chunk: int
    ) -> None:
        """Prompts of 5, 30, 32 (short: decoding crosses to long at position 32), 33
        and 70 (long from the first token) prefilled and decoded together give
        ``generate``'s logits and tokens, whole (128), in chunks of 16 (each shorter
        than the threshold: a long prompt's chunks still rotate long) and of 5."""
        prompts = {"r5": 5, "r30": 30, "r32": 32, "r33": 33, "r70": 70}
        _check(hf_checkpoint, step_driver, prompts, chunk=chunk, steps=8)

    def test_decoding_alone_across_the_threshold(
        self, hf_checkpoint: HFGet, step_driver: Any
    ) -> None:
        """One short prompt decoding past position 32 (decode-only steps of one row):
        its earlier keys keep their short rotation, as transformers' cache does."""
        _check(hf_checkpoint, step_driver, {"a": 20}, chunk=16, steps=24)

    def test_the_factors_matter(self, hf_checkpoint: HFGet) -> None:
        """The check can fail: the long and short tables differ, and a long prompt run
        as one call by transformers differs from its short-factor rotation."""
        hf_model, path = hf_checkpoint(VARIANT)
        runner = ModelRunner.load(
            str(path), dtype="float32", device="cpu", block_size=16, num_blocks=8,
            max_model_len=128,
        )  # fmt: skip
        rotary = runner.model.rotary
        assert rotary.long_rope == LongRope(THRESHOLD, 128)
        assert rotary.cos_cache.shape[0] == 256
        assert not torch.allclose(rotary.cos_cache[5], rotary.cos_cache[128 + 5])
        runner.close()
        prompt = _prompt(40, 0)
        with torch.no_grad():
            whole = hf_model(torch.tensor([prompt])).logits[0, 30]  # 40 tokens: long
            short = hf_model(torch.tensor([prompt[:31]])).logits[0, 30]  # 31: short
        assert (whole - short).abs().max().item() > 1e-2


def test_rows() -> None:
    """A request's token rotates long when its prompt or its position + 1 passes the
    threshold."""
    rule = LongRope(threshold=4, offset=100)
    assert rule.rows([0, 3, 4, 9], [4, 4, 4, 4]) == [0, 3, 104, 109]
    assert rule.rows([0, 3], [5, 5]) == [100, 103]
