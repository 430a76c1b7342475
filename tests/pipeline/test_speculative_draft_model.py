"""Speculative decoding with a draft model (issue 28): a small model with the target's
vocabulary proposes greedily, the target verifies; the tokens are those of decoding
without it, the target as its own draft keeps (nearly) every draft, and what cannot work
is refused by name."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from checkpoints import build_checkpoint

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError
from stages.propose import ProposeStage
from stages.speculative.draft_model import DraftModelProposer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _draft(model: str, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(3, vocab) for _ in range(6)]
    return [phrase * 5, [rng.randrange(3, vocab) for _ in range(23)], [rng.randrange(3, vocab)]]


def _run(model: str, prompts: list[list[int]], params: Any, **config: Any) -> tuple[list, tuple]:
    with LLM(EngineConfig(model=model, **config)) as llm:
        outputs = llm.generate(prompts, params)
        counts = llm.engine.core.scheduler.spec_decode_counts
        stages = llm.engine.core.engine_graph.stages
        if "speculative_config" in config:
            stage = next(s for s in stages if isinstance(s, ProposeStage))
            proposer = stage.proposer
            assert isinstance(proposer, DraftModelProposer)
            runner = proposer.runner
    if "speculative_config" in config:
        assert runner._closed  # the engine closed the draft's runner with it
    return [tuple(o.token_ids) for o in outputs], counts


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different, smaller random Llama with the test checkpoints' vocabulary."""
    path = tmp_path_factory.mktemp("draft") / "llama"
    return build_checkpoint("llama", path, seed=9, num_hidden_layers=1, hidden_size=32,
                            intermediate_size=64, num_attention_heads=2)  # fmt: skip


class TestTokens:
    def test_the_target_as_its_own_draft_keeps_nearly_every_draft(self) -> None:
        prompts = _prompts(512)
        plain, _ = _run("builtin:tiny", prompts, GREEDY)
        spec, (drafted, kept) = _run("builtin:tiny", prompts, GREEDY,
                                     speculative_config=_draft("builtin:tiny"))  # fmt: skip
        assert spec == plain
        assert drafted > 0 and kept >= 0.9 * drafted, (kept, drafted)

    def test_a_smaller_draft_gives_the_targets_tokens(
        self, llama_path: Path, small_draft: Path
    ) -> None:
        """A draft that guesses worse: drafts are proposed and verified, some rejected,
        and the tokens stay the target's (greedy, and seeded sampling)."""
        prompts = _prompts(256)
        seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
        params = [GREEDY, seeded, GREEDY]
        plain, _ = _run(str(llama_path), prompts, params, dtype="float32")
        spec, (drafted, kept) = _run(str(llama_path), prompts, params, dtype="float32",
                                     speculative_config=_draft(str(small_draft)))  # fmt: skip
        assert spec == plain and drafted > kept

    def test_under_kv_pressure_and_with_two_worker_processes(self) -> None:
        prompts = _prompts(512) * 2
        plain, _ = _run("builtin:tiny", prompts, GREEDY)
        with LLM(EngineConfig(model="builtin:tiny", num_gpu_blocks=10,
                              speculative_config=_draft("builtin:tiny"))) as llm:  # fmt: skip
            tight = [tuple(o.token_ids) for o in llm.generate(prompts, GREEDY)]
            drafted, _ = llm.engine.core.scheduler.spec_decode_counts
            assert llm.engine.core.scheduler.num_preemptions > 0
        assert tight == plain and drafted > 0
        spec = _draft("builtin:tiny")
        two, (drafted, _) = _run("builtin:tiny", prompts, GREEDY, executor="multiproc",
                                 world_size=2, speculative_config=spec)  # fmt: skip
        assert two == plain and drafted > 0

    def test_shared_storage_second_engine_reuses_the_stored_kv(self, tmp_path: Path) -> None:
        """Blocks of kept tokens are saved; a second engine (empty prefix cache) loads
        them for prompts that extend the first outputs and gives the same tokens as an
        engine without speculation or connector."""
        prompts = _prompts(512)
        store = {"path": str(tmp_path / "kv")}
        connector: dict[str, Any] = {"connector": "shared_storage", "connector_options": store}
        spec = _draft("builtin:tiny")
        first, _ = _run("builtin:tiny", prompts, GREEDY, speculative_config=spec, **connector)
        longer = [p + list(t[:-1]) for p, t in zip(prompts, first, strict=True)]
        plain, _ = _run("builtin:tiny", longer, GREEDY)
        with LLM(EngineConfig(model="builtin:tiny", speculative_config=spec, **connector)) as llm:
            outs = llm.generate(longer, GREEDY)
        assert [tuple(o.token_ids) for o in outs] == plain
        assert sum(o.num_cached_tokens for o in outs) >= 16 * len(prompts)

    def test_in_process_the_draft_runs_on_the_targets_compute_thread(self) -> None:
        """One thread for all torch work of the process (a second one slows the first's
        ops), and closing the draft leaves the target's thread to the target."""
        config = EngineConfig(model="builtin:tiny", speculative_config=_draft("builtin:tiny"))
        with LLM(config) as llm:
            core = llm.engine.core
            stage = next(s for s in core.engine_graph.stages if isinstance(s, ProposeStage))
            proposer = stage.proposer
            assert isinstance(proposer, DraftModelProposer)
            assert proposer.runner.compute is core.workers[0].runner.compute
            llm.generate(_prompts(512), GREEDY)

    def test_the_draft_runs_in_the_targets_dtype(
        self, small_draft: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``dtype="auto"`` resolves against the target's checkpoint (bfloat16 here, on a
        CPU said to have native bfloat16), and the draft, saved in float32, runs in that
        dtype too rather than resolving against its own checkpoint."""
        import json
        import shutil

        import torch

        from stages.model import runner_parts

        monkeypatch.setattr(runner_parts, "cpu_has_native_bf16", lambda: True)
        target = tmp_path / "target"
        shutil.copytree(small_draft, target)
        config = json.loads((target / "config.json").read_text())
        config.pop("torch_dtype", None)
        config["dtype"] = "bfloat16"
        (target / "config.json").write_text(json.dumps(config))
        draft_config = json.loads((small_draft / "config.json").read_text())
        assert (draft_config.get("dtype") or draft_config.get("torch_dtype")) == "float32"
        spec = _draft(str(small_draft))
        with LLM(EngineConfig(model=str(target), speculative_config=spec)) as llm:
            core = llm.engine.core
            stage = next(s for s in core.engine_graph.stages if isinstance(s, ProposeStage))
            proposer = stage.proposer
            assert isinstance(proposer, DraftModelProposer)
            assert {t.dtype for t in core.workers[0].runner.kv_caches} == {torch.bfloat16}
            assert {t.dtype for t in proposer.runner.kv_caches} == {torch.bfloat16}


class TestProposer:
    def test_rejected_drafts_are_computed_again(self) -> None:
        """The draft's KV follows the request: after a guess the target rejected, the
        draft proposes from the kept tokens as a fresh draft would."""
        fresh = DraftModelProposer.load("builtin:tiny", 3, vocab_size=512, num_blocks=16,
                                        device="cpu", max_model_len=256)  # fmt: skip
        used = DraftModelProposer.load("builtin:tiny", 3, vocab_size=512, num_blocks=16,
                                       device="cpu", max_model_len=256)  # fmt: skip
        try:
            tokens = [5, 9, 200, 31, 77, 140]
            guess = used.propose_batch({"r": (tokens, 3)})["r"]
            assert len(guess) == 3
            wrong = (guess[0] + 1) % 512  # the target disagreed with the first draft
            later = used.propose_batch({"r": ([*tokens, wrong], 3)})["r"]
            assert later == fresh.propose_batch({"f": ([*tokens, wrong], 3)})["f"]
            used.retain(())
            assert len(used._free) == used.runner.num_blocks  # every block back
        finally:
            fresh.close()
            used.close()

    def test_no_room_means_no_drafts(self) -> None:
        proposer = DraftModelProposer.load("builtin:tiny", 3, vocab_size=512, num_blocks=2,
                                           block_size=4, device="cpu",
                                           max_model_len=64)  # fmt: skip
        try:
            assert proposer.propose_batch({"r": (list(range(1, 12)), 3)}) == {"r": []}
            assert proposer.propose_batch({"s": ([1, 2, 3], 3)})["s"] != []
        finally:
            proposer.close()


class TestRefused:
    def test_a_draft_with_another_vocabulary(self, llama_path: Path) -> None:
        """builtin:tiny has 512 tokens, the test Llama 256."""
        with pytest.raises(InvalidConfigError, match=r"speculative_config\.model.*vocabulary"):
            LLM(EngineConfig(model="builtin:tiny",
                             speculative_config=_draft(str(llama_path))))  # fmt: skip

    @pytest.mark.parametrize(
        ("value", "match"),
        [
            ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
            ({**_draft("builtin:tiny"), "prompt_lookup_max": 3}, "unknown keys"),
            ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown keys"),
        ],
    )
    def test_keys_the_method_does_not_take(self, value: dict[str, Any], match: str) -> None:
        with pytest.raises(InvalidConfigError, match=match):
            EngineConfig(speculative_config=value)
