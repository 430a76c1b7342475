"""One worker rank: its model runner, its connector half and its step graph."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.errors import WorkerFailedError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.steplog import StepLog, bind_step
from stages.finished import UnsentTransfers

if TYPE_CHECKING:
    from connectors.base import KVConnectorWorker

__all__ = ["Worker"]


class Worker:
    """Runs the worker graph for one rank, one step at a time.

    Args:
        rank: This worker's rank.
        graph: The worker graph (``bind → load → forward → {sample | save} → finished ⟂
            clear → drop_finished``): ``bind`` opens the connector's step, the
            finalizers clear it and drop the finished requests of a step that ended
            before its forward pass.
        connector: The rank's worker-side connector (wrapped in the lifecycle guard), or
            ``None``.
        runner: The rank's model runner (owned: closed by :meth:`close`).
        step_log: Where step records go.
    """

    def __init__(
        self,
        rank: int,
        graph: StepGraph,
        *,
        connector: KVConnectorWorker | None,
        runner: Any,
        step_log: StepLog,
    ) -> None:
        self.rank = rank
        self.graph = graph
        self.connector = connector
        self.runner = runner
        self.step_log = step_log
        self.steps = 0
        self.unsent = UnsentTransfers()  # the rank's state across steps: a graph input

    async def step(self, scheduler_output: SchedulerOutput) -> WorkerOutput:
        """Run one step of the worker graph; the ``clear`` finalizer runs whatever happens.

        Cancellation-safe: cancelling it runs the finalizers and re-raises.

        Raises:
            WorkerFailedError: A stage or finalizer failed; carries this rank's report.
        """
        step_id = scheduler_output.step_id
        ctx = StepContext(step_id, self.rank, inputs=(scheduler_output, self.unsent))
        with bind_step(step_id, self.rank):
            try:
                await self.graph.run(ctx)
            except Exception as exc:
                raise WorkerFailedError(self.rank, step_id, repr(exc), report=ctx.report) from exc
            finally:
                self.steps += 1
                if ctx.report is not None:
                    self.step_log.record_step(
                        ctx.report,
                        kind="worker",
                        batch_size=len(scheduler_output.requests),
                        num_tokens=scheduler_output.total_num_scheduled_tokens,
                    )
        return ctx.get(WorkerOutput)

    async def aclose(self) -> None:
        """Close the connector and release the runner; idempotent."""
        try:
            if self.connector is not None:
                await self.connector.aclose()
        finally:
            close = getattr(self.runner, "close", None)
            if close is not None:
                close()
