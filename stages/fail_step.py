"""``fail_step``: the engine graph's failure path, a finalizer.

A step that fails (a rank raised or missed the deadline, a stage raised, the step's task
was cancelled) fails its own requests, not the engine. This finalizer does that after the
engine graph's body, whatever stage failed; on a step that succeeded it does nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import anyio
import attrs

from pipeline.artifacts import EngineStepOutput, SchedulerOutput
from pipeline.errors import StepCancelledError
from pipeline.kernel.context import StepContext
from pipeline.kernel.failure import describe_failure
from pipeline.kernel.stage import Finalizer
from pipeline.logs import get_logger
from stages.aggregator import FanInAggregator
from stages.execute import Executor, answered_outputs

if TYPE_CHECKING:
    from stages.schedule.scheduler import Scheduler

__all__ = ["FailStepStage"]

_log = get_logger()
_DONE = "fail_step.done"


def _cancelled_from_outside() -> bool:
    """Whether an enclosing cancel scope (the engine closing, a caller's deadline) is
    cancelled: the cancellation is then the caller's, not a failure of this step."""
    return anyio.current_effective_deadline() == -math.inf


@attrs.frozen
class FailStepStage(Finalizer):
    """Fails the requests of a step whose body failed; a no-op after a step that succeeded.

    In order, in its synchronous ``finalize`` (no drain):

    1. hands the aggregator the transfer reports of the ranks that did answer in a step
       ``execute`` failed (:func:`~stages.execute.answered_outputs`): their connectors
       will not repeat them;
    2. stops there when the step has no ``SchedulerOutput`` (the scheduler itself
       failed: the engine raises), when the body's error is a cancellation that an
       enclosing cancel scope asked for (the engine propagates it), or when the
       executor has lost a rank for good (the engine raises ``EngineDeadError``);
    3. otherwise describes the failure (:class:`~pipeline.errors.StepFailure`: failed
       stages, ranks, cancelled), forgets the step's requests in the aggregator, fails
       them in the scheduler, logs ``step_failed``, and stores the failed requests'
       outputs as the step's :class:`~pipeline.artifacts.EngineStepOutput`.

    A native ``task.cancel()`` of the step that no scope asked for counts as a failure
    of the step (:class:`~pipeline.errors.StepCancelledError`). Idempotent. Not
    mandatory: a graph that replaces it chooses its own failure policy; a graph without
    it makes :meth:`EngineCore.step` raise the step's error.
    """

    name: ClassVar[str] = "fail_step"

    scheduler: Scheduler
    aggregator: FanInAggregator
    executor: Executor

    def finalize(self, ctx: StepContext) -> None:
        exc = ctx.error
        if exc is None or ctx.scratch.get(_DONE):
            return
        ctx.scratch[_DONE] = True
        scheduler_output = ctx.maybe(SchedulerOutput)
        answered = answered_outputs(ctx)
        if answered is not None:
            step_id = ctx.step_id if scheduler_output is None else scheduler_output.step_id
            self.aggregator.record(step_id, answered)
        if scheduler_output is None or self.executor.failure is not None:
            return
        if ctx.cancelled:
            if _cancelled_from_outside():
                return
            cancel = exc
            exc = StepCancelledError(ctx.step_id)
            exc.__cause__ = cancel
        elif not isinstance(exc, Exception):
            return  # KeyboardInterrupt, SystemExit: not a failure of this step
        step_id = scheduler_output.step_id
        failure = describe_failure(step_id, exc, ctx.report)
        req_ids = [r.req_id for r in scheduler_output.requests]
        self.aggregator.forget(req_ids)
        failed = self.scheduler.fail_requests(req_ids, str(failure))
        _log.error(
            "step_failed",
            step_id=step_id,
            failed_stages=failure.failed_stages,
            ranks=failure.ranks,
            error=failure.message,
            requests=req_ids,
        )
        ctx.put(
            EngineStepOutput(
                step_id=step_id,
                outputs=tuple(attrs.evolve(out, failure=failure) for out in failed),
                num_requests=len(req_ids),
            )
        )
