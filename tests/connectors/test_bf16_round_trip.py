"""bfloat16 KV through the connectors: saved, loaded back, outputs unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from store_workload import PARAMS, PROMPTS, engine_config

from pipeline import LLM, EngineConfig

BS = 16


def config(path: Path, connector: str | None, options: dict[str, Any]) -> EngineConfig:
    return engine_config(path, connector, options, dtype="bfloat16")


class TestBfloat16RoundTrip:
    @pytest.mark.parametrize("connector", ["offload", "shared_storage"])
    def test_reloaded_blocks_give_identical_tokens(
        self, llama_path: Path, tmp_path: Path, connector: str
    ) -> None:
        """The second run loads every full block (bfloat16 frames) and its greedy
        tokens equal a run without any connector."""
        prompts = PROMPTS
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
