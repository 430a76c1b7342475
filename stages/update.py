"""``update``: the merged worker outputs fed back to the scheduler, the engine graph's last
stage; it yields the step's request outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs

from pipeline.artifacts import EngineStepOutput, FanInOutput, SchedulerOutput, SpecDecodeStats
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    from stages.scheduler.scheduler import Scheduler

__all__ = ["UpdateStage"]


@attrs.frozen
class UpdateStage:
    """Feeds the merged worker outputs back to the scheduler; yields request outputs."""

    name: ClassVar[str] = "update"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, FanInOutput)
    provides: ClassVar[type] = EngineStepOutput

    scheduler: Scheduler

    async def run(self, ctx: StepContext) -> EngineStepOutput:
        scheduler_output = ctx.get(SchedulerOutput)
        merged = ctx.get(FanInOutput)
        outputs = self.scheduler.update_from_output(scheduler_output, merged)
        drafted = self.scheduler.step_draft_outcomes
        return EngineStepOutput(
            step_id=scheduler_output.step_id,
            outputs=tuple(outputs),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_requests=len(scheduler_output.requests),
            stats=merged.stats,
            spec_decode=SpecDecodeStats.of(drafted.values()) if drafted else None,
        )
