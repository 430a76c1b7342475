"""``forward``: the model's pass over the step's batch, on the runner's compute thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import LoadStarted, ModelOutput, SchedulerOutput
from pipeline.kernel.compute import ComputeStage
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    from stages.model.runner import ModelRunner

__all__ = ["ForwardStage", "cost_key"]

T = TypeVar("T")


def cost_key(
    runner: ModelRunner, scheduler_output: SchedulerOutput, connector: KVConnectorWorker | None
) -> tuple[int, int] | None:
    """The shape a pass's duration is estimated by (``ComputeThread.run``'s cost key):
    the number of requests and the power of two of the token count. ``None`` (always
    on the compute thread) off the CPU, where the pass is a launch; with more than one
    rank, whose pass waits for the others'; and when a connector's layer hooks run,
    which may wait for work of the event loop's.
    """
    if runner.device.type != "cpu" or runner.world_size != 1 or connector is not None:
        return None
    tokens = scheduler_output.total_num_scheduled_tokens
    return len(scheduler_output.requests), tokens.bit_length()


@attrs.frozen
class ForwardStage(ComputeStage):
    """Runs the model on the runner's compute thread; per-layer connector hooks run there.

    A compute stage (:mod:`pipeline.kernel.compute`): the plan fuses it with the compute
    stages after it (``logits``, the user's logits stages, ``sample``) into one hand-over
    through :meth:`hop`. The event loop stays free while the pass runs, unless recent
    passes of the step's shape (:func:`cost_key`) were shorter than the runner's
    ``inline_forward_below_s``: then the fused work runs on the loop's thread, without
    the two thread wake-ups. When ``load`` bound nothing, the connector is not handed to
    the pass, so its layer hooks are not called. On a tensor-parallel rank the pass
    all-reduces with the other ranks (``collective``): a step that fails before it
    completes is fatal to the worker.
    """

    name: ClassVar[str] = "forward"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, LoadStarted)
    provides: ClassVar[type] = ModelOutput
    collective: ClassVar[bool] = True

    runner: ModelRunner
    connector: KVConnectorWorker | None = None

    def _connector(self, ctx: StepContext) -> KVConnectorWorker | None:
        return self.connector if ctx.get(LoadStarted).started else None

    def compute(self, ctx: StepContext) -> ModelOutput:
        """The forward pass (blocking): :meth:`ModelRunner.execute`."""
        return self.runner.execute(ctx.get(SchedulerOutput), self._connector(ctx))

    async def hop(self, ctx: StepContext, work: Callable[[], T]) -> T:
        """Run ``work`` (this stage's and the fused ones') on the compute thread, or here
        for an empty step without a connector (it only drops finished requests) and for
        a shape whose recent passes were short (:func:`cost_key`)."""
        scheduler_output = ctx.get(SchedulerOutput)
        connector = self._connector(ctx)
        if scheduler_output.is_empty and connector is None:
            return work()
        key = cost_key(self.runner, scheduler_output, connector)
        return await self.runner.compute.run(work, cost_key=key)
