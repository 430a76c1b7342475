"""``schedule`` and ``update``: the engine-side stages on either side of the workers.

``execute`` (running the ranks) is :mod:`stages.execute`; ``fan_in`` (merging their
outputs) is :mod:`stages.fan_in`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs

from pipeline.artifacts import EngineStepOutput, FanInOutput, SchedulerOutput
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    from stages.schedule.scheduler import Scheduler

__all__ = ["ScheduleStage", "UpdateStage"]


@attrs.frozen
class ScheduleStage:
    """Runs the scheduler: which requests advance this step and by how many tokens."""

    name: ClassVar[str] = "schedule"
    requires: ClassVar[tuple[type, ...]] = ()
    provides: ClassVar[type] = SchedulerOutput

    scheduler: Scheduler

    async def run(self, ctx: StepContext) -> SchedulerOutput:
        return self.scheduler.schedule()


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
        return EngineStepOutput(
            step_id=scheduler_output.step_id,
            outputs=tuple(outputs),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_requests=len(scheduler_output.requests),
            stats=merged.stats,
        )
