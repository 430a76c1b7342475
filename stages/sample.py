"""``sample``: one token per row of the step's (amended) logits, and the logprobs asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

import attrs

from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from pipeline.kernel.compute import ComputeStage
from pipeline.kernel.context import StepContext
from pipeline.logits import Logits

if TYPE_CHECKING:
    from stages.model.runner import ModelRunner

__all__ = ["SampleStage"]

T = TypeVar("T")


@attrs.frozen
class SampleStage(ComputeStage):
    """Samples one token per row of the last version of the step's
    :class:`~pipeline.logits.Logits` (greedy, temperature, min-p, top-k, top-p, per-request
    seeds), and computes the logprobs the requests asked for (sampled tokens, prompt
    tokens) from the raw logits. A row a logits stage failed, or that cannot be sampled,
    gets no token and its request fails alone (``SampledTokens.errors``).

    Only the driver rank samples (``driver=True``); the other ranks return nothing, and
    fan-in takes the driver's tokens.
    """

    name: ClassVar[str] = "sample"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, ModelOutput, Logits)
    provides: ClassVar[type] = SampledTokens

    runner: ModelRunner
    driver: bool = True

    def compute(self, ctx: StepContext) -> SampledTokens:
        """The sampled tokens (blocking: reads them back from the device)."""
        model_output = ctx.get(ModelOutput)
        if not self.driver or not (model_output.req_ids or model_output.prompt_logits is not None):
            return SampledTokens()
        return self.runner.sample_logits(ctx.get(SchedulerOutput), model_output, ctx.get(Logits))

    async def hop(self, ctx: StepContext, work: Callable[[], T]) -> T:
        """Run ``work`` on the runner's compute thread."""
        return await self.runner.compute.run(work)
