"""The connector lifecycle on every step of every rank, seen through RecordingConnector."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import ClassVar

import anyio
import attrs
import pytest

from connectors.testing import RecordingConnector
from pipeline import AsyncEngine, EngineConfig, ModelOutput, SamplingParams, StepContext

pytestmark = pytest.mark.anyio

BODY = ("bind_connector_metadata", "start_load_kv")
LAYER = {"wait_for_layer_load", "save_kv_layer"}
TAIL = ("wait_for_save", "get_finished")
CLEAR = "clear_connector_metadata"


def worker_sequences() -> dict[tuple[int, int], list[str]]:
    seqs: dict[tuple[int, int], list[str]] = defaultdict(list)
    for call in RecordingConnector.calls:
        if call.role == "worker" and call.step_id is not None:
            seqs[(call.rank, call.step_id)].append(call.method)
    return seqs


def assert_lifecycle(seq: list[str], *, complete: bool) -> None:
    """bind → start_load → layer hooks → wait_for_save → get_finished → clear, clear once."""
    assert seq.count(CLEAR) == 1 and seq[-1] == CLEAR, seq
    body = [m for m in seq[:-1] if m not in LAYER and m != "get_block_ids_with_load_errors"]
    body = [m for m in body if m != "get_kv_stats"]
    full = [*BODY, *TAIL]
    if complete:
        assert body == full, seq
    else:
        assert body == full[: len(body)], seq
    if LAYER & set(seq):
        first = min(i for i, m in enumerate(seq) if m in LAYER)
        last = max(i for i, m in enumerate(seq) if m in LAYER)
        assert seq.index("start_load_kv") < first and last < seq.index("wait_for_save"), seq


@attrs.frozen
class Probe:
    step_id: int


@attrs.frozen
class FailAt:
    """Raises (or hangs) after forward on the chosen steps of the chosen rank."""

    name: ClassVar[str] = "fault"
    requires: ClassVar[tuple[type, ...]] = (ModelOutput,)
    provides: ClassVar[type] = Probe

    steps: frozenset[int]
    rank: int
    hang: bool = False

    async def run(self, ctx: StepContext) -> Probe:
        if ctx.rank == self.rank and ctx.step_id in self.steps:
            if self.hang:
                await anyio.sleep(30)
            raise RuntimeError(f"injected fault at step {ctx.step_id}")
        return Probe(ctx.step_id)


def _config(path: Path, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(path), dtype="float32", max_model_len=512, connector="recording", **kw
    )


@pytest.fixture(autouse=True)
def _reset_recording():
    RecordingConnector.reset()
    yield
    RecordingConnector.reset()


class TestLifecycle:
    @pytest.mark.parametrize("world_size", [1, 3])
    async def test_every_step_every_rank_follows_the_lifecycle(
        self, llama_path: Path, world_size: int, leak_check
    ):
        """Each rank's calls per step follow the order, and metadata is None after."""
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(_config(llama_path, world_size=world_size)) as engine:
            async with anyio.create_task_group() as tg:
                for n in (3, 20, 40):
                    tg.start_soon(_consume, engine, list(range(1, n + 1)), params)
            await engine.core.step()  # a step with nothing scheduled still clears
            leak_check(engine.leak_report())
            for worker in engine.core.workers:
                assert worker.connector.connector_metadata is None
        seqs = worker_sequences()
        ranks = {rank for rank, _ in seqs}
        assert ranks == set(range(world_size))
        for seq in seqs.values():
            assert_lifecycle(seq, complete=True)
        layered = [s for s in seqs.values() if "wait_for_layer_load" in s]
        assert layered, "layer hooks never ran"
        scheduler_methods = {c.method for c in RecordingConnector.calls if c.role == "scheduler"}
        assert {"get_num_new_matched_tokens", "build_connector_meta", "request_finished"} <= (
            scheduler_methods
        )

    @pytest.mark.parametrize("hang", [False, True])
    async def test_failing_or_cancelled_stage_still_clears_once(
        self, llama_path: Path, hang: bool, leak_check
    ):
        """A stage that raises (or hangs past the fan-in deadline and is cancelled) on one
        rank fails that step's requests; clear still ran exactly once on every rank."""
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        fault = FailAt(frozenset({3}), rank=1, hang=hang)
        config = _config(llama_path, world_size=2, fan_in_timeout_s=1.0)
        async with AsyncEngine(
            config, worker_graph=lambda g: g.insert_after("forward", fault)
        ) as engine:
            failed = await _consume(engine, [1, 2, 3, 4, 5], params)
            assert failed.finish_reason == "error"
            assert failed.failure is not None and failed.failure.step_id == 3
            assert failed.failure.ranks == (1,)
            if hang:
                assert failed.failure.cancelled
                assert "execute" in failed.failure.failed_stages
            else:
                assert "rank1:fault" in failed.failure.failed_stages
                assert "injected fault" in failed.failure.message
            ok = await _consume(engine, [9, 8, 7], params)
            assert ok.finish_reason == "length" and len(ok.token_ids) == 6
            leak_check(engine.leak_report())
            for worker in engine.core.workers:
                assert worker.connector.connector_metadata is None
        seqs = worker_sequences()
        for (_rank, step), seq in seqs.items():
            assert_lifecycle(seq, complete=step != 3)
        assert (0, 3) in seqs and (1, 3) in seqs


async def _consume(engine: AsyncEngine, prompt: list[int], params: SamplingParams):
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last
