"""bfloat16 KV through the connectors: saved, loaded back, outputs unchanged."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM, EngineConfig, SamplingParams

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def workload() -> list[list[int]]:
    """Two prompts sharing three full blocks, one unrelated."""
    rng = random.Random(11)
    base = [rng.randrange(1, 256) for _ in range(48)]
    return [
        [*base, *[rng.randrange(1, 256) for _ in range(9)]],
        [*base, *[rng.randrange(1, 256) for _ in range(21)]],
        [rng.randrange(1, 256) for _ in range(40)],
    ]


def config(path: Path, connector: str | None, options: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="bfloat16",
        max_model_len=256,
        enable_prefix_caching=False,
        connector=connector,
        connector_options=options,
    )


class TestBfloat16RoundTrip:
    @pytest.mark.parametrize("connector", ["offload", "shared_storage"])
    def test_reloaded_blocks_give_identical_tokens(
        self, llama_path: Path, tmp_path: Path, connector: str
    ) -> None:
        """The second run loads every full block (bfloat16 frames) and its greedy
        tokens equal a run without any connector."""
        prompts = workload()
        with LLM(config(llama_path, None, {})) as llm:
            reference = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        options: dict[str, Any] = (
            {"num_blocks": 32} if connector == "offload" else {"path": str(tmp_path / "kv")}
        )
        with LLM(config(llama_path, connector, options)) as llm:
            first = llm.generate(prompts, PARAMS)
            second = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in first] == reference
        assert [o.token_ids for o in second] == reference
        assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BS * BS for p in prompts]
