"""``fan_in``: merge every rank's ``WorkerOutput`` of one step.

``execute`` has already run the ranks (under the deadline) and collected their outputs;
this stage only merges them, without awaiting anything. The merging itself (driver
rank's tokens, unions, summed stats, per-request rank sets with leases) is
:class:`~stages.aggregator.FanInAggregator`'s.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from pipeline.artifacts import FanInOutput, RankOutputs
from pipeline.kernel.context import StepContext
from stages.aggregator import FanInAggregator

__all__ = ["FanInAggregator", "FanInStage"]


@attrs.frozen
class FanInStage:
    """Merges the ranks' outputs (:class:`~pipeline.artifacts.RankOutputs`) into one.

    Never awaits: it has no cancellation point. The requests the executor left out of
    the step (``RankOutputs.request_errors``) join the ranks' own per-request errors.

    Raises:
        StageError: An output's rank is outside ``[0, world_size)``.
    """

    name: ClassVar[str] = "fan_in"
    requires: ClassVar[tuple[type, ...]] = (RankOutputs,)
    provides: ClassVar[type] = FanInOutput

    aggregator: FanInAggregator

    async def run(self, ctx: StepContext) -> FanInOutput:
        ranks = ctx.get(RankOutputs)
        merged = self.aggregator.merge(ranks.step_id, ranks.outputs)
        if not ranks.request_errors:
            return merged
        return attrs.evolve(
            merged, request_errors={**ranks.request_errors, **merged.request_errors}
        )
