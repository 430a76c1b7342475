"""A request that fails at run time fails alone; its step's other rows finish (finding 2)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.artifacts import WorkerOutput
from stages.aggregator import FanInAggregator
from stages.model.sampling import Sampler

POISON_SEED = 666
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GOOD = [
    SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True),
]
POISONED = SamplingParams(max_tokens=5, temperature=0.8, seed=POISON_SEED, ignore_eos=True)


def _config(path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path), dtype="float32", max_model_len=128, enable_prefix_caching=False
    )


@pytest.fixture
def poisoned_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler raises for any batch holding a row seeded with POISON_SEED."""
    original = Sampler._sample_random

    def sample_random(
        self: Sampler,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        indices: Sequence[int],
    ) -> torch.Tensor:
        if any(p.seed == POISON_SEED for p in params):
            raise FloatingPointError("injected: this row cannot be sampled")
        return original(self, logits, params, indices)

    monkeypatch.setattr(Sampler, "_sample_random", sample_random)


class TestOneRowFails:
    def test_a_row_that_cannot_be_sampled_fails_only_its_request(
        self, llama_path: Path, poisoned_sampler: None
    ) -> None:
        """Finding 2: a row whose sampling raises fails its request; the others are unaffected."""
        with LLM(_config(llama_path)) as llm:
            alone = [llm.generate([p], params)[0] for p, params in zip(PROMPTS, GOOD, strict=False)]
            together = llm.generate(PROMPTS, [*GOOD, POISONED])
            again = llm.generate(PROMPTS[:2], GOOD)
        assert [o.finish_reason for o in alone] == ["length", "length"]
        assert [o.finish_reason for o in together] == ["length", "length", "error"]
        assert together[2].error is not None and "sampling failed" in together[2].error
        assert "FloatingPointError" in together[2].error
        assert [o.token_ids for o in together[:2]] == [o.token_ids for o in alone]
        assert [o.token_ids for o in again] == [o.token_ids for o in alone]


class TestFanInUnion:
    def test_request_errors_are_unioned_over_ranks(self) -> None:
        """Finding 2: fan-in merges every rank's per-request errors (lowest rank's reason)."""
        agg = FanInAggregator(2, lease_s=60.0)
        merged = agg.merge(
            1,
            [
                WorkerOutput(rank=1, step_id=1, request_errors={"a": "rank1", "b": "rank1"}),
                WorkerOutput(rank=0, step_id=1, request_errors={"a": "rank0"}),
            ],
        )
        assert merged.request_errors == {"a": "rank0", "b": "rank1"}


class TestSamplerRows:
    def test_sample_rows_reports_the_failing_row(self, poisoned_sampler: None) -> None:
        """Finding 2: the sampler falls back to row-by-row and names the failing row."""
        logits = torch.randn(3, 16)
        params = [GOOD[0], POISONED, GOOD[1]]
        sampler = Sampler(seed=0, device=torch.device("cpu"))
        tokens, errors = sampler.sample_rows(logits, params, [0, 0, 0])
        assert list(errors) == [1] and tokens[1] is None
        alone = Sampler(seed=0, device=torch.device("cpu"))
        assert tokens[0] == alone.sample(logits[0:1], [GOOD[0]], [0])[0]
        assert tokens[2] == alone.sample(logits[2:3], [GOOD[1]], [0])[0]
