"""The worker step's lifecycle lives in its stages and finalizers (issue 11): ``bind``
opens the connector's step, ``drop_finished`` drops the finished requests of a step that
ended early, and a stage that declares collectives decides whether a failure is fatal to
a tensor-parallel worker."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, ClassVar

import attrs
import pytest

from connectors.base import ConnectorContext, KVConnectorRole
from connectors.lifecycle import GuardedWorker
from connectors.testing import RecordingConnector
from pipeline.artifacts import MetadataBound, ModelOutput, SchedulerOutput
from pipeline.errors import StageError
from pipeline.executors import wire
from pipeline.executors.remote_worker import Records, breaks_group, collective_stages, run_step
from pipeline.executors.worker import Worker
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StageRecord, StepReport
from pipeline.kernel.stage import is_collective
from pipeline.steplog import StepLog
from stages.bind import BindStage
from stages.drop_finished import DropFinishedStage
from stages.forward import ForwardStage


@pytest.fixture(autouse=True)
def _reset() -> Any:
    RecordingConnector.reset()
    yield
    RecordingConnector.reset()


def _guarded() -> GuardedWorker:
    return GuardedWorker(RecordingConnector.Worker(ConnectorContext(role=KVConnectorRole.WORKER)))


@pytest.mark.anyio
class TestBindOpensTheStep:
    async def test_begins_the_step_even_without_metadata(self) -> None:
        """A step with no metadata still opens the connector's step (so clear is allowed)."""
        connector = _guarded()
        ctx = StepContext(5, 0, inputs=(SchedulerOutput(step_id=5),))
        bound = await BindStage(connector).run(ctx)
        assert bound == MetadataBound(False)
        assert connector.last_call == "begin_step" and connector.step_id == 5
        connector.clear_connector_metadata()  # allowed: the step is open

    async def test_every_worker_connector_can_begin_a_step(self) -> None:
        """An unguarded connector's begin_step is the API's no-op: no isinstance needed."""
        raw = RecordingConnector.Worker(ConnectorContext(role=KVConnectorRole.WORKER))
        ctx = StepContext(1, 0, inputs=(SchedulerOutput(step_id=1),))
        assert await BindStage(raw).run(ctx) == MetadataBound(False)


@attrs.define
class _Runner:
    dropped: list[frozenset[str]] = attrs.field(factory=list)

    def drop_requests(self, req_ids: Iterable[str]) -> None:
        self.dropped.append(frozenset(req_ids))


class TestDropFinished:
    def _ctx(self, *, forward_done: bool) -> StepContext:
        so = SchedulerOutput(step_id=2, finished_req_ids=frozenset({"x", "y"}))
        ctx = StepContext(2, 0, inputs=(so,))
        if forward_done:
            ctx.put(ModelOutput(req_ids=(), logits=None))
        return ctx

    def test_drops_when_the_forward_pass_did_not_complete(self) -> None:
        """No ModelOutput: the runner drops the finished requests, once."""
        runner = _Runner()
        stage = DropFinishedStage(runner)
        ctx = self._ctx(forward_done=False)
        stage.finalize(ctx)
        stage.finalize(ctx)
        assert runner.dropped == [frozenset({"x", "y"})]

    def test_leaves_them_to_a_completed_forward_pass(self) -> None:
        """With a ModelOutput the forward pass dropped them itself: nothing to do."""
        runner = _Runner()
        DropFinishedStage(runner).finalize(self._ctx(forward_done=True))
        assert runner.dropped == []


@attrs.frozen
class _Fails:
    """A stage after ``first`` that raises; ``collective`` as given."""

    name: str
    collective: bool
    requires: tuple[type, ...] = (SchedulerOutput,)
    provides: ClassVar[None] = None

    async def run(self, ctx: StepContext) -> None:
        raise StageError(self.name, ctx.step_id, "injected")


@attrs.frozen
class _Ok:
    name: ClassVar[str] = "first"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput,)
    provides: ClassVar[None] = None

    async def run(self, ctx: StepContext) -> None:
        return None


def _sharded_worker(graph: StepGraph) -> Worker:
    runner = SimpleNamespace(tp=SimpleNamespace(sharded=True))
    return Worker(0, graph, connector=None, runner=runner, step_log=StepLog(None))


class TestCollectiveStages:
    def test_forward_declares_collectives(self) -> None:
        """The built-in forward stage is the collective one; others are not."""
        assert ForwardStage.collective is True and is_collective(ForwardStage)
        assert not is_collective(BindStage(None))

    def test_decision_asks_every_collective_stage(self) -> None:
        """A failure is fatal unless every collective stage completed (or no report)."""
        ok = StageRecord("forward", "ok", 0.0, 0.0, False, None)
        failed = StageRecord("reduce", "error", 0.0, 0.0, False, "boom")
        report = StepReport(1, 0, "error", 0.0, (ok, failed), "reduce", ())
        assert breaks_group(report, {"forward", "reduce"})
        assert not breaks_group(report, {"forward"})
        assert not breaks_group(report, set())
        assert breaks_group(None, {"forward"})

    @pytest.mark.anyio
    @pytest.mark.parametrize("collective", [True, False])
    async def test_a_failing_custom_stage_is_fatal_only_if_collective(
        self, collective: bool
    ) -> None:
        """A sharded worker whose failing stage declares collectives stops; else it serves."""
        graph = StepGraph(
            [_Ok(), _Fails("reduce", collective)], inputs=(SchedulerOutput,), name="worker"
        )
        worker = _sharded_worker(graph)
        assert collective_stages(graph) == (frozenset({"reduce"}) if collective else frozenset())
        step = wire.Step(scheduler_output=SchedulerOutput(step_id=3))
        reply = await run_step(worker, step, Records(), 5.0)
        assert isinstance(reply, wire.StepFailed)
        assert (reply.step_id, reply.fatal) == (3, collective)
