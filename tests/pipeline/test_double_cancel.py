"""Two native task.cancel() calls in a row during a step's drain still leave metadata cleared."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import anyio
import attrs
import pytest

from connectors.base import ConnectorContext, KVConnectorRole
from connectors.lifecycle import GuardedWorker
from connectors.testing import FaultStage, RecordingConnector, RecordingMetadata, check_lifecycle
from pipeline.artifacts import ModelOutput, ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.executors.worker import Worker
from pipeline.kernel.context import StepContext
from pipeline.kernel.stage import Finalizer
from pipeline.steplog import StepLog
from stages.graphs import default_worker_graph
from stages.model.runner import ModelRunner

pytestmark = pytest.mark.anyio

CLEAR = "clear_connector_metadata"


@attrs.frozen
class Drain(Finalizer):
    """A finalizer whose awaited part drains for a long time (shielded, bounded)."""

    name: ClassVar[str] = "drain"

    started: asyncio.Event = attrs.field(factory=asyncio.Event, eq=False)
    release: asyncio.Event = attrs.field(factory=asyncio.Event, eq=False)
    timeout_s: float = 30.0
    seen: list[str] = attrs.field(factory=list, eq=False)

    async def run(self, ctx: StepContext) -> None:
        self.started.set()
        await self.release.wait()
        self.seen.append("drained")

    def finalize(self, ctx: StepContext) -> None:
        self.seen.append("finalize")


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    RecordingConnector.reset()
    yield
    RecordingConnector.reset()


@pytest.fixture
def runner(llama_path: Path) -> Iterator[ModelRunner]:
    model = ModelRunner.load(
        str(llama_path), dtype="float32", device="cpu", num_blocks=16, max_model_len=64
    )
    yield model
    model.close()


def _worker(runner: ModelRunner, drain: Drain, *, hang_in_body: bool) -> Worker:
    raw = RecordingConnector.Worker(ConnectorContext(role=KVConnectorRole.WORKER))
    connector = GuardedWorker(raw)
    connector.register_kv_caches(runner.kv_caches)
    graph = default_worker_graph(runner, connector=connector).with_finalizer(drain)
    if hang_in_body:
        hang = FaultStage(action="hang", requires=(ModelOutput,), times=None, hang_s=30)
        graph = graph.insert_after("forward", hang)
    return Worker(0, graph, connector=connector, runner=runner, step_log=StepLog(None))


def _step(step_id: int) -> SchedulerOutput:
    request = ScheduledRequest(
        req_id="r",
        token_ids=(1, 2, 3, 4),
        num_computed_tokens=0,
        block_ids=(0,),
        new=True,
        sampling=SamplingParams(temperature=0.0),
        sample=True,
        num_output_tokens=0,
    )
    return SchedulerOutput(
        step_id=step_id,
        requests=(request,),
        kv_connector_metadata=RecordingMetadata(step_id, ("r",)),
    )


class TestDoubleCancelDuringDrain:
    @pytest.mark.parametrize("hang_in_body", [False, True], ids=["body-done", "body-hangs"])
    async def test_clear_runs_once_and_the_cancellation_propagates(
        self, runner: ModelRunner, hang_in_body: bool
    ) -> None:
        """Cancelled twice while the drain awaits (after a finished body, or after a body
        that hung and was cancelled by a first cancel), the step clears exactly once,
        unbinds the metadata and ends its task cancelled."""
        drain = Drain()
        worker = _worker(runner, drain, hang_in_body=hang_in_body)
        task = asyncio.ensure_future(worker.step(_step(0)))
        with anyio.fail_after(10):
            if hang_in_body:
                while "get_finished" not in RecordingConnector.methods():
                    await asyncio.sleep(0.001)
                assert not drain.started.is_set()  # the body still hangs
                task.cancel()
            await drain.started.wait()
        task.cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert drain.seen == ["finalize"]  # the drain was cut, its finalize ran
        methods = RecordingConnector.methods(step_id=0)
        assert methods.count(CLEAR) == 1 and methods[-1] == CLEAR
        assert check_lifecycle(RecordingConnector.calls) == []
        assert worker.connector is not None and worker.connector.connector_metadata is None

    async def test_the_next_step_runs_normally(self, runner: ModelRunner) -> None:
        """After a double cancel, the rank's next step begins and completes."""
        drain = Drain()
        worker = _worker(runner, drain, hang_in_body=False)
        first = asyncio.ensure_future(worker.step(_step(0)))
        with anyio.fail_after(10):
            await drain.started.wait()
        first.cancel()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        drain.release.set()
        out = await worker.step(attrs.evolve(_step(1), finished_req_ids=frozenset({"r"})))
        assert out.step_id == 1 and set(out.sampled_token_ids) == {"r"}
        assert check_lifecycle(RecordingConnector.calls) == []
        assert RecordingConnector.methods(step_id=1)[-1] == CLEAR
        assert drain.seen == ["finalize", "drained", "finalize"]
