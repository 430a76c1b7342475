"""``logits``: the built-in logits adjustments, the first version of the step's
:class:`~pipeline.logits.Logits` (see :mod:`pipeline.logits` for the seam)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

import attrs

from pipeline.artifacts import ModelOutput, SchedulerOutput
from pipeline.kernel.compute import ComputeStage
from pipeline.kernel.context import StepContext
from pipeline.logits import Logits

if TYPE_CHECKING:
    from stages.model.runner import ModelRunner

__all__ = ["LogitsAdjustStage"]

T = TypeVar("T")


@attrs.frozen
class LogitsAdjustStage(ComputeStage):
    """The rows to sample with ``min_tokens``, ``logit_bias`` and the repetition,
    frequency and presence penalties applied, as vLLM's sampler applies them
    (:func:`~stages.model.sampling.adjust_logits`); a row that cannot be adjusted
    fails alone. User logits stages go after it (``g.insert_after("logits", ...)``).

    Only the driver rank samples (``driver=True``); on the others the batch is empty.
    Fused with ``forward`` and ``sample`` in the default graph; alone it hands its work
    to the runner's compute thread.
    """

    name: ClassVar[str] = "logits"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, ModelOutput)
    provides: ClassVar[type] = Logits

    runner: ModelRunner
    driver: bool = True

    def compute(self, ctx: StepContext) -> Logits:
        """The adjusted logits (blocking)."""
        if not self.driver:
            return Logits()
        return self.runner.logits(ctx.get(SchedulerOutput), ctx.get(ModelOutput))

    async def hop(self, ctx: StepContext, work: Callable[[], T]) -> T:
        """Run ``work`` on the runner's compute thread."""
        return await self.runner.compute.run(work)
