"""``forward`` and ``sample``: the model's pass over the step's batch, off the event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import LoadStarted, ModelOutput, SampledTokens, SchedulerOutput
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    from stages.forward.runner import ModelRunner

__all__ = ["ForwardStage", "SampleStage"]


@attrs.frozen
class ForwardStage:
    """Runs the model on the runner's compute thread; per-layer connector hooks run there.

    The event loop stays free while the pass runs. When ``load`` bound nothing, the
    connector is not handed to the pass, so its layer hooks are not called. On a
    tensor-parallel rank the pass all-reduces with the other ranks (``collective``): a
    step that fails before it completes is fatal to the worker.
    """

    name: ClassVar[str] = "forward"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, LoadStarted)
    provides: ClassVar[type] = ModelOutput
    collective: ClassVar[bool] = True

    runner: ModelRunner
    connector: KVConnectorWorker | None = None

    async def run(self, ctx: StepContext) -> ModelOutput:
        scheduler_output = ctx.get(SchedulerOutput)
        connector = self.connector if ctx.get(LoadStarted).started else None
        if scheduler_output.is_empty and connector is None:
            return self.runner.execute(scheduler_output, None)  # drops finished state only
        return await self.runner.compute.run(self.runner.execute, scheduler_output, connector)


@attrs.frozen
class SampleStage:
    """Samples one token per request that reached the end of its known tokens, and
    computes the logprobs the requests asked for (sampled tokens, prompt tokens).

    Only the driver rank samples (``driver=True``); the other ranks return nothing, and
    fan-in takes the driver's tokens.
    """

    name: ClassVar[str] = "sample"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, ModelOutput)
    provides: ClassVar[type] = SampledTokens

    runner: ModelRunner
    driver: bool = True

    async def run(self, ctx: StepContext) -> SampledTokens:
        model_output = ctx.get(ModelOutput)
        if not self.driver or (not model_output.req_ids and model_output.prompt_logits is None):
            return SampledTokens()
        return await self.runner.compute.run(
            self.runner.sample, ctx.get(SchedulerOutput), model_output
        )
