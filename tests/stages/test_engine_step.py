"""The engine step as it runs: ``execute`` runs the ranks, ``fan_in`` merges, and the
``fail_step`` finalizer fails the requests of a step that failed (issue 11)."""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import pytest
from fake_executor import FakeRanks, hang
from schedule_driver import make_scheduler

from pipeline.artifacts import (
    EngineStepOutput,
    FanInOutput,
    RankOutputs,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.config import SamplingParams
from pipeline.errors import WorkerDiedError, WorkerFailedError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.request import Request
from stages.aggregator import FanInAggregator
from stages.execute import ExecuteStage, answered_outputs
from stages.fail_step import FailStepStage
from stages.fan_in import FanInStage
from stages.graphs import default_engine_graph, default_worker_graph
from stages.schedule import ScheduleStage
from stages.scheduler.scheduler import Scheduler
from stages.update import UpdateStage


def answer(rank: int, step: int, **fields: Any) -> Any:
    async def waiter() -> WorkerOutput:
        await anyio.sleep(0)
        return WorkerOutput(rank=rank, step_id=step, **fields)

    return waiter


def boom(rank: int, step: int) -> Any:
    async def waiter() -> WorkerOutput:
        raise WorkerFailedError(rank, step, f"injected on rank {rank}")

    return waiter


def _context(step: int) -> StepContext:
    return StepContext(step, None, inputs=(SchedulerOutput(step_id=step),))


@pytest.mark.anyio
class TestExecuteStage:
    async def test_returns_every_ranks_output_in_rank_order(self) -> None:
        """execute awaits each rank once and returns their outputs, rank 0 first."""
        executor = FakeRanks([answer(0, 7, sampled_token_ids={"a": 5}), answer(1, 7), answer(2, 7)])
        ranks = await ExecuteStage(executor).run(_context(7))
        assert isinstance(ranks, RankOutputs)
        assert ranks.step_id == 7 and executor.submitted == [7]
        assert [o.rank for o in ranks.outputs] == [0, 1, 2]
        assert ranks.outputs[0].sampled_token_ids == {"a": (5,)}

    async def test_carries_the_requests_the_executor_left_out(self) -> None:
        """The executor's per-request errors ride along in RankOutputs."""
        executor = FakeRanks([answer(0, 1)], request_errors={"bad": "not encodable"})
        ranks = await ExecuteStage(executor).run(_context(1))
        assert ranks.request_errors == {"bad": "not encodable"}

    async def test_a_rank_past_the_deadline_fails_the_step_at_execute(self) -> None:
        """Rank 1 hanging past timeout_s: the step fails in execute, naming rank 1;
        fan_in never runs; rank 0's output is left for the failure finalizer."""
        executor = FakeRanks([answer(0, 2), hang()])
        graph = StepGraph(
            [ExecuteStage(executor, timeout_s=0.05), FanInStage(FanInAggregator(2))],
            inputs=(SchedulerOutput,),
        )
        ctx = _context(2)
        with pytest.raises(WorkerFailedError) as info:
            await graph.run(ctx)
        assert info.value.rank == 1 and "deadline" in str(info.value)
        assert ctx.report is not None and ctx.report.failed_stage == "execute"
        assert ctx.report.stage("fan_in").outcome == "skipped"
        answered = answered_outputs(ctx)
        assert answered is not None and [o.rank for o in answered] == [0]

    async def test_nothing_is_left_behind_on_success(self) -> None:
        """A step whose ranks all answered leaves no outputs for the failure path."""
        ctx = _context(0)
        await ExecuteStage(FakeRanks([answer(0, 0)])).run(ctx)
        assert answered_outputs(ctx) is None


@pytest.mark.anyio
class TestFanInIsAPureMerge:
    async def test_merges_without_awaiting(self) -> None:
        """fan_in's coroutine completes on its first send: it has no await point."""
        agg = FanInAggregator(2)
        ctx = _context(4)
        outputs = (
            WorkerOutput(rank=0, step_id=4, sampled_token_ids={"a": 1}),
            WorkerOutput(rank=1, step_id=4, finished_sending=frozenset({"x"})),
        )
        ctx.put(RankOutputs(step_id=4, outputs=outputs, request_errors={"b": "why"}))
        coro = FanInStage(agg).run(ctx)
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        merged = done.value.value
        assert isinstance(merged, FanInOutput)
        assert merged.sampled_token_ids == {"a": (1,)} and merged.num_ranks == 2
        assert merged.request_errors == {"b": "why"}
        assert agg.pending_ranks("sending", "x") == {1}

    def test_declares_rank_outputs_only(self) -> None:
        """fan_in needs the ranks' outputs and nothing of the executor."""
        assert FanInStage.requires == (RankOutputs,)
        assert not any(f.name == "timeout_s" for f in attrs.fields(FanInStage))


def _scheduler_with(*req_ids: str) -> Scheduler:
    scheduler = make_scheduler()
    for req_id in req_ids:
        scheduler.add_request(Request(req_id, [1, 2, 3], SamplingParams(max_tokens=2)))
    return scheduler


def _engine_graph(scheduler: Scheduler, executor: FakeRanks, agg: FanInAggregator) -> StepGraph:
    return StepGraph(
        [
            ScheduleStage(scheduler),
            ExecuteStage(executor, timeout_s=5.0),
            FanInStage(agg),
            UpdateStage(scheduler),
            FailStepStage(scheduler, agg, executor),
        ],
        name="engine",
    )


@pytest.mark.anyio
class TestFailStepFinalizer:
    async def test_fails_the_requests_of_a_failing_step(self) -> None:
        """A rank failing: fail_step fails the step's requests, naming stage and rank,
        and leaves their outputs as the step's EngineStepOutput."""
        scheduler = _scheduler_with("a", "b")
        agg = FanInAggregator(2)
        graph = _engine_graph(scheduler, FakeRanks([answer(0, 0), boom(1, 0)]), agg)
        ctx = StepContext(0)
        with pytest.raises(WorkerFailedError):
            await graph.run(ctx)
        result = ctx.get(EngineStepOutput)
        assert {o.request_id for o in result.outputs} == {"a", "b"}
        for out in result.outputs:
            assert out.finished and out.finish_reason == "error"
            assert out.failure is not None and out.failure.ranks == (1,)
            assert "execute" in out.failure.failed_stages
        assert not scheduler.has_unfinished_requests()
        assert ctx.report is not None and ctx.report.stage("fail_step").outcome == "ok"

    async def test_does_nothing_on_a_step_that_succeeds(self) -> None:
        """All ranks answering: the requests advance and fail_step leaves them alone."""
        scheduler = _scheduler_with("a")
        executor = FakeRanks([answer(0, 0, sampled_token_ids={"a": 9})])
        graph = _engine_graph(scheduler, executor, FanInAggregator(1))
        ctx = StepContext(0)
        await graph.run(ctx)
        result = ctx.get(EngineStepOutput)
        assert [(o.request_id, o.token_ids, o.failure) for o in result.outputs] == [
            ("a", (9,), None)
        ]
        assert scheduler.has_unfinished_requests()

    async def test_leaves_a_dead_engine_to_the_engine(self) -> None:
        """With a rank gone for good, fail_step fails nothing (the engine raises)."""
        scheduler = _scheduler_with("a")
        executor = FakeRanks([boom(0, 0)], failure=WorkerDiedError(0, 0, "gone"))
        ctx = StepContext(0)
        with pytest.raises(WorkerFailedError):
            await _engine_graph(scheduler, executor, FanInAggregator(1)).run(ctx)
        assert EngineStepOutput not in ctx
        assert scheduler.has_unfinished_requests()


class TestDefaultGraphs:
    def test_the_engine_graph_reads_as_it_runs(self) -> None:
        """Printing the default engine graph gives the step in the order it runs."""
        graph = default_engine_graph(
            make_scheduler(), FakeRanks([]), aggregator=FanInAggregator(1), fan_in_timeout_s=3.0
        )
        assert str(graph) == "schedule → execute → fan_in → update ⟂ fail_step"
        assert graph["execute"].timeout_s == 3.0

    def test_the_worker_graph_reads_as_it_runs(self) -> None:
        """The default worker graph: clear first among the finalizers, then drop_finished."""
        runner: Any = object()
        graph = default_worker_graph(runner)
        assert str(graph) == (
            "bind → load → forward → logits → structured → sample → save → finished "
            "⟂ clear → drop_finished"
        )
