"""The failure path in one place (issue 25): ``fail_step`` reads typed artifacts, one
helper tells whose cancellation it is, and :func:`step_error` is what the engine
re-raises; the graph kernel knows nothing of worker ranks."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_executor import FakeRanks
from schedule_driver import make_scheduler

import pipeline.kernel
from pipeline.artifacts import EngineStepOutput, SchedulerOutput, WorkerOutput
from pipeline.errors import EngineDeadError, StepCancelledError, WorkerFailedError
from pipeline.kernel.context import StepContext
from stages.aggregator import FanInAggregator
from stages.execute import AnsweredRanks, ExecuteStage
from stages.fail_step import FailStepStage, cancelled_from_outside, step_error

ROOT = Path(__file__).resolve().parents[2]


def _failed_context(step: int, exc: BaseException, *artifacts: object) -> StepContext:
    ctx = StepContext(step, None, inputs=artifacts)
    ctx.error = exc
    ctx.cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    return ctx


@pytest.mark.anyio
class TestCancelledFromOutside:
    async def test_true_under_a_cancelled_scope(self) -> None:
        """A deadline around the task: the cancellation is the caller's."""
        seen: list[bool] = []
        with anyio.move_on_after(0.01):
            try:
                await anyio.sleep(5)
            except anyio.get_cancelled_exc_class():
                seen.append(cancelled_from_outside())
                raise
        assert seen == [True]

    async def test_false_for_a_native_task_cancel(self) -> None:
        """A native task.cancel() that no scope asked for is not the caller's."""
        seen: list[bool] = []

        async def victim() -> None:
            try:
                await anyio.sleep(5)
            except anyio.get_cancelled_exc_class():
                seen.append(cancelled_from_outside())
                raise

        task = asyncio.ensure_future(victim())
        await anyio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == [False]

    def test_the_test_exists_once(self) -> None:
        """Only stages/fail_step.py compares the effective deadline with -inf."""
        pattern = re.compile(r"current_effective_deadline\(\)\s*==\s*-math\.inf")
        where = [
            str(path.relative_to(ROOT))
            for package in ("pipeline", "stages", "connectors")
            for path in sorted((ROOT / package).rglob("*.py"))
            if pattern.search(path.read_text(encoding="utf-8"))
        ]
        assert where == ["stages/fail_step.py"]


class TestTheKernelKnowsNoRanks:
    def test_no_worker_failure_in_the_kernel(self) -> None:
        """The kernel neither exports describe_failure nor names WorkerFailedError."""
        assert not hasattr(pipeline.kernel, "describe_failure")
        kernel = ROOT / "pipeline" / "kernel"
        assert [p.name for p in kernel.glob("*.py") if "WorkerFailedError" in p.read_text()] == []


@pytest.mark.anyio
class TestFailStepReadsArtifacts:
    async def test_execute_leaves_answered_ranks_as_an_artifact(self) -> None:
        """A failing rank: execute puts AnsweredRanks in the context, not in scratch."""

        async def ok() -> WorkerOutput:
            return WorkerOutput(rank=0, step_id=3)

        async def boom() -> WorkerOutput:
            raise RuntimeError("rank 1 down")

        ctx = StepContext(3, None, inputs=(SchedulerOutput(step_id=3),))
        with pytest.raises(WorkerFailedError):
            await ExecuteStage(FakeRanks([ok, boom])).run(ctx)
        answered = ctx.maybe(AnsweredRanks)
        assert answered is not None and answered.step_id == 3
        assert [o.rank for o in answered.outputs] == [0]
        assert ctx.scratch == {}

    async def test_fail_step_records_the_reports_of_answered_ranks(self) -> None:
        """fail_step hands the transfer reports in AnsweredRanks to the aggregator."""
        agg = FanInAggregator(2)
        answered = AnsweredRanks(
            step_id=5,
            outputs=(WorkerOutput(rank=0, step_id=5, finished_sending=frozenset({"x"})),),
        )
        exc = WorkerFailedError(1, 5, "down")
        ctx = _failed_context(5, exc, SchedulerOutput(step_id=5), answered)
        FailStepStage(make_scheduler(), agg, FakeRanks([])).finalize(ctx)
        assert agg.pending_ranks("sending", "x") == {0}
        result = ctx.maybe(EngineStepOutput)
        assert result is not None and result.step_id == 5


@pytest.mark.anyio
class TestStepError:
    """:func:`step_error`: what EngineCore.step re-raises (the table's last column)."""

    async def test_a_failed_step_returns(self) -> None:
        """Requests failed by fail_step (EngineStepOutput present): nothing to raise."""
        exc = RuntimeError("fan_in broke")
        ctx = _failed_context(1, exc, SchedulerOutput(step_id=1), EngineStepOutput(step_id=1))
        assert step_error(ctx, exc, dead=None) is None

    async def test_the_scheduler_failing_is_re_raised(self) -> None:
        """No SchedulerOutput: the engine's state is unknown, the error goes up."""
        exc = RuntimeError("scheduler broke")
        assert step_error(_failed_context(1, exc), exc, dead=None) is exc

    async def test_a_dead_engine_raises_its_death(self) -> None:
        """A rank gone for good: the engine's EngineDeadError, not the step's error."""
        exc = WorkerFailedError(0, 1, "gone")
        dead = EngineDeadError("worker rank 0 died")
        ctx = _failed_context(1, exc, SchedulerOutput(step_id=1))
        assert step_error(ctx, exc, dead=dead) is dead

    async def test_no_finalizer_failed_the_step(self) -> None:
        """A graph without fail_step leaves no outputs: the step's error goes up."""
        exc = RuntimeError("update broke")
        ctx = _failed_context(1, exc, SchedulerOutput(step_id=1))
        assert step_error(ctx, exc, dead=None) is exc

    async def test_interrupts_propagate(self) -> None:
        """KeyboardInterrupt is nobody's step failure."""
        exc = KeyboardInterrupt()
        ctx = _failed_context(1, exc, SchedulerOutput(step_id=1), EngineStepOutput(step_id=1))
        assert step_error(ctx, exc, dead=None) is exc

    async def test_a_native_cancel_becomes_a_step_failure(self) -> None:
        """A native task.cancel() of the step: consumed; the step returns its outputs, or,
        without a SchedulerOutput, a StepCancelledError goes up."""
        results: list[Any] = []

        async def step(*artifacts: object) -> None:
            try:
                await anyio.sleep(5)
            except anyio.get_cancelled_exc_class() as exc:
                ctx = _failed_context(2, exc, *artifacts)
                results.append(step_error(ctx, exc, dead=None))
                results.append(asyncio.current_task().cancelling())  # type: ignore[union-attr]

        for artifacts in ((SchedulerOutput(step_id=2), EngineStepOutput(step_id=2)), ()):
            task = asyncio.ensure_future(step(*artifacts))
            await anyio.sleep(0.01)
            task.cancel()
            await task  # the cancel was consumed: the task ends normally
        assert results[0] is None and results[1] == 0
        assert isinstance(results[2], StepCancelledError) and results[3] == 0
        assert isinstance(results[2].__cause__, asyncio.CancelledError)
