"""``drop_finished``: a step that ended before its forward pass still forgets the
requests the scheduler finished.

The scheduler sends the ids of the requests it finished once, in the next step's
``SchedulerOutput.finished_req_ids``; the forward pass drops their state on the rank. A
step that failed or was cancelled before its forward pass completed must drop them
here, or the rank keeps their state forever.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol

import attrs

from pipeline.artifacts import ModelOutput, SchedulerOutput
from pipeline.kernel.context import StepContext
from pipeline.kernel.stage import Finalizer

__all__ = ["DropFinishedStage", "DropsRequests"]

_DONE = "drop_finished.done"


class DropsRequests(Protocol):
    """What ``drop_finished`` needs of a model runner (``ModelRunner`` has it)."""

    def drop_requests(self, req_ids: Iterable[str]) -> None:
        """Forget the state of ``req_ids``; unknown ids are ignored. Synchronous; never
        called while a forward pass of this runner runs."""
        ...


@attrs.frozen
class DropFinishedStage(Finalizer):
    """Drops ``finished_req_ids`` from the runner when the step has no ``ModelOutput``.

    A no-op after a step whose forward pass completed (it dropped them itself), and on a
    step that finished no request. Idempotent; nothing to drain.
    """

    name: ClassVar[str] = "drop_finished"

    runner: DropsRequests

    def finalize(self, ctx: StepContext) -> None:
        if ModelOutput in ctx or ctx.scratch.get(_DONE):
            return
        ctx.scratch[_DONE] = True
        scheduler_output = ctx.maybe(SchedulerOutput)
        if scheduler_output is not None and scheduler_output.finished_req_ids:
            self.runner.drop_requests(scheduler_output.finished_req_ids)
