"""A rank's finished transfers are never lost with a step that fails after making its
output: a finalizer that fails (the connector's clear reporting a failure) or a
cancellation discards the WorkerOutput, so the Worker keeps what it reported for the
next step. (Lost, a producer's held send was never freed: the NIXL pair fault test
hung in CI on exactly this, under async scheduling.)"""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

from connectors.types import WorkerFinished
from pipeline.artifacts import LoadStarted, SampledTokens, SaveResult, SchedulerOutput
from pipeline.errors import WorkerFailedError
from pipeline.executors.worker import Worker
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.stage import Finalizer
from pipeline.steplog import StepLog
from stages.finished import FinishedStage, UnsentTransfers


class _Connector:
    """Answers ``get_finished`` with ``answers[i]`` on its ``i``-th call."""

    def __init__(self, answers: list[frozenset[str]]) -> None:
        self.answers = answers
        self.calls = 0

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        self.calls += 1
        return WorkerFinished(sending=self.answers[self.calls - 1])

    def get_kv_stats(self) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


async def _sampled(ctx: StepContext) -> SampledTokens:
    return SampledTokens()


async def _saved(ctx: StepContext) -> SaveResult:
    return SaveResult()


async def _loaded(ctx: StepContext) -> LoadStarted:
    return LoadStarted(started=True)


@attrs.frozen
class _FailingClear(Finalizer):
    """Fails in the steps named, after the body made its output."""

    name: ClassVar[str] = "failing_clear"
    steps: frozenset[int] = frozenset()

    def finalize(self, ctx: StepContext) -> None:
        if ctx.step_id in self.steps:
            raise RuntimeError(f"injected: clear failed in step {ctx.step_id}")


@pytest.mark.anyio
async def test_transfers_of_a_step_whose_finalizer_failed_go_out_next_step() -> None:
    connector = _Connector([frozenset({"held-1"}), frozenset(), frozenset()])
    graph = StepGraph(
        [_sampled, _saved, _loaded, FinishedStage(0, connector), _FailingClear(frozenset({1}))],  # type: ignore[arg-type]
        inputs=(SchedulerOutput, UnsentTransfers),
    )
    worker = Worker(0, graph, connector=None, runner=None, step_log=StepLog())
    with pytest.raises(WorkerFailedError, match="clear failed in step 1"):
        await worker.step(SchedulerOutput(step_id=1))
    out = await worker.step(SchedulerOutput(step_id=2))
    assert out.finished_sending == {"held-1"}
    out = await worker.step(SchedulerOutput(step_id=3))
    assert out.finished_sending == frozenset()
