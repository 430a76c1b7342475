"""Logprobs end to end, against transformers on a random Llama checkpoint.

The oracle: ``log_softmax`` of transformers' float32 logits over prompt + generated
tokens. Each generated token's logprob and its top-5 alternatives, and every prompt
token's, match within 1e-4, with chunked prefill or whole prompts, in a batch where
only some requests ask; in-process and through worker processes (msgspec wire).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

from pipeline import LLM, AsyncEngine, EngineConfig, RequestOutput, SamplingParams, TokenLogprob

ATOL = 1e-4
NEW_TOKENS = 5
TOP = 5


def _config(path: Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = dict(
        model=str(path),
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
        fan_in_timeout_s=60.0,
    )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def _prompts(lengths: Sequence[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_model(llama_path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def _oracle(hf_model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` log_softmax of transformers' logits at each position."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def _check_entry(entry: TokenLogprob, row: torch.Tensor, token: int, k: int, where: str) -> None:
    """``entry`` scores ``token`` under the oracle's distribution ``row``."""
    assert entry.token_id == token, where
    expected = row[token].item()
    assert abs(entry.logprob - expected) < ATOL, f"{where}: {entry.logprob} vs {expected}"
    assert int((row > expected + ATOL).sum()) < entry.rank <= int((row >= expected - ATOL).sum())
    assert len(entry.top) == k, where
    values = row.topk(k).values.tolist() if k else []
    assert [v for _, v in entry.top] == pytest.approx(values, abs=ATOL), where
    for tok, lp in entry.top:
        assert abs(lp - row[tok].item()) < ATOL, f"{where}: top token {tok}"


def _check_output(hf_model, prompt: list[int], out: RequestOutput, params: SamplingParams) -> None:
    """Every logprob of ``out`` equals the oracle's."""
    assert out.finish_reason == "length", out.error
    tokens = [*prompt, *out.token_ids]
    lsm = _oracle(hf_model, tokens)
    p = len(prompt)
    if params.logprobs is None:
        assert out.logprobs is None
    else:
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for j, entry in enumerate(out.logprobs):
            _check_entry(entry, lsm[p - 1 + j], tokens[p + j], params.logprobs, f"token {j}")
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == p
        assert out.prompt_logprobs[0] is None
        for i in range(1, p):
            entry = out.prompt_logprobs[i]
            assert entry is not None
            _check_entry(entry, lsm[i - 1], prompt[i], params.prompt_logprobs, f"prompt {i}")


GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BOTH = SamplingParams(**GREEDY, logprobs=TOP, prompt_logprobs=TOP)  # type: ignore[arg-type]
MIXED = [
    BOTH,
    SamplingParams(**GREEDY),  # type: ignore[arg-type]
    SamplingParams(**GREEDY, logprobs=0),  # type: ignore[arg-type]
    SamplingParams(**GREEDY, prompt_logprobs=0),  # type: ignore[arg-type]
    BOTH,
    SamplingParams(**GREEDY, logprobs=TOP),  # type: ignore[arg-type]
]
LENGTHS = (1, 5, 40, 100, 161, 17)


class TestLogprobsMatchTransformers:
    @pytest.mark.parametrize("budget", [64, 2048], ids=["chunked", "whole"])
    def test_mixed_batch_equals_hf(self, llama_path: Path, hf_model, budget: int) -> None:
        """Prompts of 1-161 tokens in one batch, only some asking: generated and prompt
        logprobs (top 5) equal log_softmax of transformers' logits within 1e-4."""
        prompts = _prompts(LENGTHS)
        with LLM(_config(llama_path, max_num_batched_tokens=budget)) as llm:
            outs = llm.generate(prompts, MIXED)
        for prompt, out, params in zip(prompts, outs, MIXED, strict=True):
            _check_output(hf_model, prompt, out, params)

    def test_tiny_chunks_cross_blocks(self, llama_path: Path, hf_model) -> None:
        """Chunks of 7 tokens (not block aligned): the target of each chunk's last
        position is the next chunk's first token."""
        prompts = _prompts((50, 33))
        with LLM(_config(llama_path, max_num_batched_tokens=7, max_num_seqs=2)) as llm:
            outs = llm.generate(prompts, BOTH)
        for prompt, out in zip(prompts, outs, strict=True):
            _check_output(hf_model, prompt, out, BOTH)

    def test_logprobs_are_of_the_raw_logits(self, llama_path: Path, hf_model) -> None:
        """Temperature, top-k and logit_bias change what is sampled, not the logprobs
        reported: they are the model's own distribution (vLLM's default)."""
        prompt = _prompts((20,))[0]
        params = SamplingParams(
            max_tokens=6,
            temperature=1.7,
            top_k=30,
            seed=11,
            ignore_eos=True,
            logit_bias={7: 100.0},
            logprobs=3,
        )
        with LLM(_config(llama_path)) as llm:
            (out,) = llm.generate([prompt], params)
        assert 7 in out.token_ids  # the bias did act on sampling
        _check_output(hf_model, prompt, out, params)


class TestPrefixCache:
    def test_prompt_logprobs_request_takes_no_cache_hit(self, llama_path: Path, hf_model) -> None:
        """A cached prompt serves a plain request; one asking for prompt logprobs is
        computed whole (num_cached_tokens 0) and its prompt logprobs are exact."""
        prompt = _prompts((70,))[0]
        plain = SamplingParams(**GREEDY)  # type: ignore[arg-type]
        with LLM(_config(llama_path, enable_prefix_caching=True)) as llm:
            llm.generate([prompt], plain)
            (hit,) = llm.generate([prompt], plain)
            (asks,) = llm.generate([prompt], BOTH)
        assert hit.num_cached_tokens == 64
        assert asks.num_cached_tokens == 0
        _check_output(hf_model, prompt, asks, BOTH)


class TestStreaming:
    def test_outputs_are_cumulative(self, llama_path: Path) -> None:
        """Every streamed output holds one logprob per token so far; prompt logprobs
        are complete from the first output on."""
        prompt = _prompts((90,))[0]
        seen: list[RequestOutput] = []

        async def main() -> None:
            async with AsyncEngine(_config(llama_path)) as engine:
                async for out in engine.generate(prompt, BOTH):
                    seen.append(out)

        anyio.run(main)
        assert len(seen) == NEW_TOKENS
        for out in seen:
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert seen[-1].logprobs is not None
        assert seen[-1].logprobs[: len(seen[0].logprobs or ())] == seen[0].logprobs


class TestFailures:
    def test_a_request_whose_logprobs_fail_fails_alone(
        self, llama_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """When scoring one request's rows raises, that request ends with "error";
        the others in the batch, with and without logprobs, finish normally."""
        from stages.model import logprobs as module

        real = module.token_logprobs

        def flaky(logits, token_ids, num_top):
            if 7 in num_top:
                raise RuntimeError("injected logprobs failure")
            return real(logits, token_ids, num_top)

        monkeypatch.setattr(module, "token_logprobs", flaky)
        prompts = _prompts((12, 30, 8))
        params = [
            SamplingParams(**GREEDY, logprobs=7),  # type: ignore[arg-type]
            BOTH,
            SamplingParams(**GREEDY),  # type: ignore[arg-type]
        ]
        with LLM(_config(llama_path)) as llm:
            outs = llm.generate(prompts, params)
        assert outs[0].finish_reason == "error"
        assert "injected logprobs failure" in (outs[0].error or "")
        assert [o.finish_reason for o in outs[1:]] == ["length", "length"]
        assert outs[1].logprobs is not None and len(outs[1].logprobs) == NEW_TOKENS


class TestMultiproc:
    @pytest.mark.timeout(180)
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_worker_processes_give_the_same_logprobs(
        self, llama_path: Path, world_size: int
    ) -> None:
        """Through worker processes (msgspec frames, vocab-parallel logits at 2 ranks)
        the logprobs equal the in-process engine's."""
        prompts = _prompts((5, 40, 100))
        params = [BOTH, SamplingParams(**GREEDY), BOTH]  # type: ignore[arg-type]
        with LLM(_config(llama_path)) as llm:
            expected = llm.generate(prompts, params)
        cfg = _config(llama_path, executor="multiproc", world_size=world_size)
        with LLM(cfg) as llm:
            got = llm.generate(prompts, params)
        for a, b in zip(expected, got, strict=True):
            assert a.token_ids == b.token_ids
            _assert_close(a.logprobs, b.logprobs)
            _assert_close(a.prompt_logprobs, b.prompt_logprobs)


def _assert_close(
    a: Sequence[TokenLogprob | None] | None, b: Sequence[TokenLogprob | None] | None
) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < ATOL
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=ATOL)
