"""End-to-end generation through the step graphs, checked against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import build_checkpoint

from pipeline import LLM, EngineConfig, SamplingParams

PROMPT_LENGTHS = (1, 5, 16, 17, 40, 100, 161, 255, 300)
NEW_TOKENS = 6


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(generated[0, len(prompt) :].tolist())
    return outs


class TestGreedyMatchesTransformers:
    @pytest.mark.parametrize(
        "kind", ["llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma3"]
    )
    def test_batched_chunked_greedy_equals_hf(
        self, kind: str, tiny_checkpoints: dict[str, Path], leak_check
    ) -> None:
        """Prompts of 1-300 tokens, batched with chunked prefill, match HF token for token."""
        path = tiny_checkpoints[kind]
        prompts = _prompts(256)
        expected = _hf_greedy(path, prompts, NEW_TOKENS)
        config = EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=16,
            max_num_batched_tokens=64,
            max_model_len=512,
            max_num_seqs=8,
        )
        # min_tokens as HF's min_new_tokens: EOS masked until the last token (with
        # ignore_eos instead, a model whose argmax is EOS would keep it where HF does not).
        params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
        with LLM(config) as llm:
            outs = llm.generate(prompts, params)
            leak_check(llm.leak_report())
        assert [list(o.token_ids) for o in outs] == expected
        assert all(o.finish_reason == "length" for o in outs)

    def test_prefix_cache_reuse_keeps_outputs(self, llama_path: Path, leak_check) -> None:
        """A second run of the same prompts reuses cached blocks and yields the same tokens."""
        prompts = _prompts(256, seed=3)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        config = EngineConfig(
            model=str(llama_path), dtype="float32", max_num_batched_tokens=128, max_model_len=512
        )
        with LLM(config) as llm:
            first = llm.generate(prompts, params)
            second = llm.generate(prompts, params)
            leak_check(llm.leak_report())
        assert [o.token_ids for o in first] == [o.token_ids for o in second]
        assert sum(o.num_cached_tokens for o in second) > 0

    def test_preemption_under_block_pressure_keeps_outputs(
        self, llama_path: Path, leak_check
    ) -> None:
        """With too few KV blocks the scheduler preempts; outputs stay identical."""
        prompts = _prompts(256, seed=5)[3:8]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        roomy = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=512)
        tight = EngineConfig(
            model=str(llama_path), dtype="float32", max_model_len=512, num_gpu_blocks=40
        )
        with LLM(roomy) as llm:
            expected = [o.token_ids for o in llm.generate(prompts, params)]
        with LLM(tight) as llm:
            got = [o.token_ids for o in llm.generate(prompts, params)]
            leak_check(llm.leak_report())
        assert got == expected


def _check_cached_pressed_and_split(path: Path, leak_check, store: Path) -> None:
    """Greedy tokens stay transformers' with prefix-cache hits (each batch run twice),
    under block pressure (preemption), over two worker processes, and loaded from a
    connector (``shared_storage``: an engine saves, a new one loads the prompts' KV)."""
    prompts = _prompts(256)[2:6]
    expected = _hf_greedy(path, prompts, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    base = {"model": str(path), "dtype": "float32", "max_model_len": 512}
    stored = {"connector": "shared_storage", "connector_options": {"path": str(store)}}
    for options in ({}, {"num_gpu_blocks": 10}, {"executor": "multiproc", "world_size": 2},
                    stored):  # fmt: skip
        with LLM(EngineConfig(**base, **options)) as llm:
            first = llm.generate(prompts, params)
            again = llm.generate(prompts, params)
            leak_check(llm.leak_report())
        assert [list(o.token_ids) for o in first] == expected, options
        assert [list(o.token_ids) for o in again] == expected, options
        if not options:
            assert sum(o.num_cached_tokens for o in again) > 0
    with LLM(EngineConfig(**base, **stored)) as llm:  # a new engine: loads what was saved
        loaded = llm.generate(prompts, params)
    assert [list(o.token_ids) for o in loaded] == expected
    assert sum(o.metrics.num_external_tokens for o in loaded) > 0


class TestFamilies:
    @pytest.mark.parametrize("kind", ["qwen3", "phi3"])
    def test_prefix_cache_preemption_workers_and_a_connector(
        self, kind: str, tiny_checkpoints: dict[str, Path], leak_check, tmp_path: Path
    ) -> None:
        """Qwen3's and Phi-3's tokens stay transformers' with prefix-cache hits, under
        block pressure, over two worker processes and through shared_storage."""
        _check_cached_pressed_and_split(tiny_checkpoints[kind], leak_check, tmp_path)


class TestMixtureOfExperts:
    @pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
    def test_prefix_cache_preemption_and_two_worker_processes(
        self, kind: str, tiny_checkpoints: dict[str, Path], leak_check, tmp_path: Path
    ) -> None:
        """A mixture of experts' tokens stay transformers' with prefix-cache hits, under
        block pressure (preemption), split over two worker processes (experts sharded)
        and through shared_storage."""
        _check_cached_pressed_and_split(tiny_checkpoints[kind], leak_check, tmp_path)


class TestSlidingWindow:
    def test_prefix_cache_preemption_and_two_worker_processes(
        self, tiny_checkpoints: dict[str, Path], leak_check, tmp_path: Path
    ) -> None:
        """Gemma 3's tokens (prompts of 16-100 tokens, window 8) stay transformers' with
        prefix-cache hits (cached blocks older than the window reused), under block
        pressure (preemption), split over two worker processes (heads sharded) and
        through shared_storage."""
        _check_cached_pressed_and_split(tiny_checkpoints["gemma3"], leak_check, tmp_path)


class TestSampling:
    def test_seeded_sampling_is_reproducible_across_batches(self, llama_path: Path) -> None:
        """A seeded request samples the same tokens alone and inside a batch."""
        prompts = _prompts(256, seed=7)[:4]
        seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
        config = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=512)
        with LLM(config) as llm:
            alone = llm.generate([prompts[0]], seeded)[0].token_ids
            batch = llm.generate(prompts, [seeded] + [SamplingParams(max_tokens=8)] * 3)
        assert batch[0].token_ids == alone


_LONGROPE = {"type": "longrope",
             "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
             "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 13.0, 19.0]}  # fmt: skip


@pytest.fixture(scope="module")
def longrope_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama and Phi-3 checkpoints with longrope scaling: long factors past 32
    positions (Llama's transformers config reads longrope as Phi-3's does)."""
    root = tmp_path_factory.mktemp("longrope")
    return {
        kind: build_checkpoint(kind, root / kind, max_position_embeddings=128,
                               original_max_position_embeddings=32, rope_scaling=_LONGROPE)
        for kind in ("llama", "phi3")
    }  # fmt: skip


class TestLongRope:
    """longrope (original_max_position_embeddings 32): the short or long factors per
    request and token, as transformers picks them per forward call."""

    def _run(
        self, path: Path, batches: list[list[list[int]]], new_tokens: int, leak_check: Any
    ) -> list[Any]:
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
        config = EngineConfig(model=str(path), dtype="float32", block_size=16,
                              max_num_batched_tokens=16, max_model_len=128)  # fmt: skip
        with LLM(config) as llm:
            outs = [o for batch in batches for o in llm.generate(batch, params)]
            leak_check(llm.leak_report())
        return outs

    def test_llama_greedy_equals_generate_with_prefix_cache(
        self, longrope_paths: dict[str, Path], leak_check: Any
    ) -> None:
        """A 20-token prompt decoding across position 32 and a 45-token one, batched in
        chunks of 16, give ``generate``'s tokens (its decode steps switch to the long
        factors at position 32, the cache keeping its short keys); then a 40-token
        prompt that starts with the 20-token one (whose cached first block was rotated
        short) does too: a long prompt never reuses a short one's blocks, and reuses its
        own (run twice)."""
        short, long = _prompts(256, seed=7)[4][:20], _prompts(256, seed=8)[5][:45]
        extended = short + _prompts(256, seed=9)[4][:20]
        path = longrope_paths["llama"]
        expected = _hf_greedy(path, [short, long, extended], 16)
        outs = self._run(path, [[short, long], [extended], [extended]], 16, leak_check)
        assert [list(o.token_ids) for o in outs] == [*expected, expected[2]]
        assert outs[2].num_cached_tokens == 0
        assert outs[3].num_cached_tokens > 0

    def test_phi3_greedy_equals_generate(
        self, longrope_paths: dict[str, Path], leak_check: Any
    ) -> None:
        """Phi-3: prompts of 45 and 70 tokens (long throughout) and of 12 (short
        throughout: decoding ends before position 32), batched in chunks of 16, give
        ``generate``'s tokens."""
        prompts = [_prompts(256, seed=8)[5][:45], _prompts(256, seed=10)[5][:70],
                   _prompts(256, seed=11)[4][:12]]  # fmt: skip
        path = longrope_paths["phi3"]
        expected = _hf_greedy(path, prompts, 16)
        assert [list(o.token_ids) for o in self._run(path, [prompts], 16, leak_check)] == expected
