"""The engine's step links are typed graph inputs (issue 25): under async scheduling the
engine graph takes every step's :class:`StepLink` as an input, and the step log reads
the link's wait from the step's artifacts, not from a scratch key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from stages.schedule import StepLink

pytestmark = pytest.mark.timeout(120)


def _config(path: Path, log: Path, ahead: bool) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        block_size=16,
        max_model_len=128,
        max_num_seqs=4,
        async_scheduling=ahead,
        step_log=str(log),
    )


@pytest.mark.anyio
@pytest.mark.parametrize("ahead", [True, False])
async def test_the_engine_graph_takes_the_link_under_async_scheduling(
    llama_path: Path, tmp_path: Path, ahead: bool
) -> None:
    """Async scheduling: StepLink is the engine graph's input and every engine step's
    record has the link's wait; without it, neither."""
    log = tmp_path / "steps.jsonl"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(_config(llama_path, log, ahead)) as engine:
        assert engine.core.engine_graph.inputs == ((StepLink,) if ahead else ())
        async for out in engine.generate([1, 2, 3, 4], params):
            final = out
        assert final.finished and len(final.token_ids) == 4
    records = [json.loads(line) for line in log.read_text().splitlines()]
    engine_steps = [r for r in records if r.get("kind") == "engine" and r["event"] == "step"]
    assert engine_steps
    assert all(("waited_for_previous_ms" in r) is ahead for r in engine_steps)
