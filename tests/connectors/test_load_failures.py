"""Blocks that fail to load: recompute gives identical outputs; ``fail`` fails only the
affected request. The fault is real: the tier's slot for the chosen block is overwritten
with another key's bytes, so the worker's check on load rejects it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from connectors.offload import OffloadScheduler, OffloadWorker
from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.block_hashes import hash_request_tokens

BS = 16
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
VICTIM = 1  # the request whose block is corrupted
POSITIONS = {"first": 0, "middle": 2, "last": 4}  # block index in a 5-full-block prompt


def workload() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in (70, 85, 50, 33)]


def config(path: Path, **overrides) -> EngineConfig:
    fields = dict(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=64,  # chunked prefill as well
        enable_prefix_caching=False,
        connector="offload",
        connector_options={"num_blocks": 64},
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def corrupt_block(llm: LLM, prompt: list[int], block: int) -> None:
    """Overwrite the tier's slot of ``prompt``'s block ``block`` on every rank."""
    connector = llm.engine.core.connector
    assert isinstance(connector, OffloadScheduler)
    block_hash = hash_request_tokens(prompt, BS)[block]
    slot = connector.index.lookup((connector.fingerprint_key, block_hash))
    assert slot is not None, "the block was not stored by the first run"
    for worker in llm.engine.core.workers:
        inner = worker.connector.inner
        assert isinstance(inner, OffloadWorker)
        inner.pool.keys[slot] = inner.key_prefix + bytes(32)
        for layer in inner.pool.layers:
            layer[slot].normal_()


@pytest.fixture(scope="module")
def reference(tiny_checkpoints) -> list[tuple[int, ...]]:
    """Greedy outputs without any connector."""
    plain = config(tiny_checkpoints["llama"], connector=None, connector_options={})
    with LLM(plain) as llm:
        return [o.token_ids for o in llm.generate(workload(), PARAMS)]


class TestLoadFailures:
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("position", list(POSITIONS))
    def test_recompute_keeps_outputs_identical(
        self, llama_path: Path, reference, position: str, world_size: int, tmp_path: Path
    ) -> None:
        """Under recompute, a failed first/middle/last block changes no output."""
        prompts = workload()
        log = tmp_path / "steps.jsonl"
        with LLM(config(llama_path, world_size=world_size, step_log=str(log))) as llm:
            assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == reference
            corrupt_block(llm, prompts[VICTIM], POSITIONS[position])
            second = llm.generate(prompts, PARAMS)
            errors = [w.connector.inner.stats.load_errors for w in llm.engine.core.workers]
        steps = [json.loads(line) for line in log.read_text().splitlines()]
        engine_steps = [r for r in steps if r["event"] == "step" and r["kind"] == "engine"]
        assert sum(r["load_error_blocks"] for r in engine_steps) >= 1  # the log shows it
        assert sum(r["loaded_tokens"] for r in engine_steps) > 0
        assert [o.token_ids for o in second] == reference
        assert all(o.finish_reason == "length" for o in second)
        assert all(e >= 1 for e in errors), errors
        # the victim reused only the blocks before the bad one
        assert second[VICTIM].num_cached_tokens <= POSITIONS[position] * BS

    @pytest.mark.parametrize("position", list(POSITIONS))
    def test_fail_policy_fails_only_the_affected_request(
        self, llama_path: Path, reference, position: str
    ) -> None:
        """Under fail, only the request with the bad block ends with an error."""
        prompts = workload()
        with LLM(config(llama_path, load_failure_policy="fail")) as llm:
            llm.generate(prompts, PARAMS)
            corrupt_block(llm, prompts[VICTIM], POSITIONS[position])
            second = llm.generate(prompts, PARAMS)
        assert second[VICTIM].finish_reason == "error"
        assert second[VICTIM].error
        for index, out in enumerate(second):
            if index != VICTIM:
                assert out.finish_reason == "length"
                assert out.token_ids == reference[index]
