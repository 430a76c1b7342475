"""How an engine step fails: the one place that decides what a failure costs.

A failing step fails its own requests, not the engine; only what leaves the engine in an
unknown state (the scheduler itself failing, a rank gone for good) ends it. Every cause,
where it is caught, what the step's requests see and what the engine does
("error": ``finish_reason="error"`` with a :class:`~pipeline.errors.StepFailure` in
``RequestOutput.failure``; "serves on": :meth:`EngineCore.step` returns those outputs):

==  =========================  ==========================  ======================  ============
#   Cause                      Where caught                What requests see       Engine
==  =========================  ==========================  ======================  ============
1   a worker stage raises      rank's runner → execute     error, rank<r>:stage    serves on
    on rank ``r``              (WorkerFailedError) →       in failed_stages,
                               :class:`FailStepStage`      ranks == (r,)
2   a rank misses the          execute's ``fail_after``    error, ``cancelled``    serves on
    ``fan_in_timeout_s``       → FailStepStage
3   a rank's task gets a       the in-process rank task    error, ranks == (r,)    serves on
    native ``task.cancel()``   → execute → FailStepStage
4   an engine stage raises     the engine graph's runner   error, names the stage  serves on
    (fan_in, update, yours)    → FailStepStage
5   the step's task gets a     FailStepStage, then         error, ``cancelled``    serves on
    native ``task.cancel()``   :func:`step_error`
6   an enclosing cancel scope  nowhere                     nothing: the caller's   propagates
    (closing, a deadline)      (:func:`cancelled_from_
                               outside`)
7   only finalizers fail       the runner                  their outputs, as if    logs, serves
                               (FinalizerError)            nothing failed          on
8   the scheduler raises (no   nowhere                     ``EngineDeadError``     re-raises:
    SchedulerOutput)                                                               dead
9   a rank is gone for good    the executor's ``failure``  ``EngineDeadError``     raises
    (exit, fatal TP failure)   (FailStepStage skips)                               EngineDead
10  no finalizer failed the    nowhere                     ``EngineDeadError``     re-raises:
    step (no fail_step)                                                            dead
11  KeyboardInterrupt,         nowhere                     nothing                 propagates
    SystemExit
12  one request's error        executor / rank →           that request alone:     serves on
    (unsendable, a row, a      ``request_errors`` →        error (a load under
    failed KV load)            ``update``                  ``recompute``: none)
13  a save-side connector      the forward's hooks, the    nothing: tokens kept;   counts
    call raises on a rank      ``save``/``finished``       the step's saves fail   (``kv_save_
    (``save_kv_layer``,        stages → ``WorkerOutput.    (not stored, not        failures``),
    ``wait_for_save``,         save_failures`` →           announced)              serves on
    ``get_finished``)          ``update``
==  =========================  ==========================  ======================  ============

Row 13: a cancellation or a ``ConnectorLifecycleError`` there is still row 1-3, and
load-side calls (``start_load_kv``, ``wait_for_layer_load``, the load-error queries)
still fail the step as row 1.

Row 1 and 2: the ranks that did answer leave their outputs as
:class:`~stages.execute.AnsweredRanks`, and FailStepStage hands their transfer reports to
the aggregator (their connectors will not repeat them). Rows 8-10: the step loop dies and
every caller gets ``EngineDeadError`` (:class:`~pipeline.engine.async_engine.AsyncEngine`).

:func:`step_error` is what :meth:`EngineCore.step <pipeline.engine.core.EngineCore.step>`
asks after the graph raised: what to re-raise, or nothing when the step failed alone.
:func:`cancelled_from_outside` is the one test of whose cancellation it is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import anyio
import attrs

from pipeline.artifacts import EngineStepOutput, SchedulerOutput
from pipeline.errors import StepCancelledError, StepFailure, WorkerFailedError
from pipeline.kernel.context import StepContext
from pipeline.kernel.report import StepReport
from pipeline.kernel.stage import Finalizer
from pipeline.logger import get_logger
from stages.aggregator import FanInAggregator
from stages.execute import AnsweredRanks, Executor

if TYPE_CHECKING:
    from stages.scheduler.scheduler import Scheduler

__all__ = [
    "FailStepStage",
    "cancelled_from_outside",
    "consume_native_cancel",
    "describe_failure",
    "step_error",
]

_log = get_logger()
_DONE = "fail_step.done"


def cancelled_from_outside() -> bool:
    """Whether an enclosing cancel scope of the current task is cancelled (the engine
    closing, a caller's deadline, ``execute``'s deadline over a rank): the cancellation
    is then the caller's, to propagate. ``False`` inside a native ``task.cancel()`` that
    no scope asked for, which is a failure of the step (or rank) instead.

    Call it while handling the cancellation; non-blocking.
    """
    return anyio.current_effective_deadline() == -math.inf


def consume_native_cancel() -> None:
    """Consume a native asyncio ``task.cancel()`` of the current task, once the engine
    turned it into a step failure, so the task does not stay cancelled. No-op under trio
    (no native cancel) or when the task is not being cancelled."""
    try:
        import asyncio

        task = asyncio.current_task()
    except RuntimeError:  # not running under asyncio
        return
    if task is not None and task.cancelling():
        task.uncancel()


def step_error(
    ctx: StepContext, exc: BaseException, *, dead: Exception | None
) -> BaseException | None:
    """What :meth:`EngineCore.step` raises after the engine graph raised ``exc``, or
    ``None`` when the step failed alone (its requests were failed by
    :class:`FailStepStage`) and the step returns their outputs (the table above).

    A native cancel of the step's task that no scope asked for is consumed here
    (:func:`consume_native_cancel`) and becomes a :class:`StepCancelledError`.

    Args:
        ctx: The step's context, after the graph ran.
        exc: What the graph raised.
        dead: The engine's death (``EngineDeadError``), if a rank is gone for good.
    """
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        if cancelled_from_outside():
            return exc
        consume_native_cancel()
        cancelled = StepCancelledError(ctx.step_id)
        cancelled.__cause__ = exc
        exc = cancelled
    if not isinstance(exc, Exception):
        return exc  # KeyboardInterrupt, SystemExit
    if ctx.maybe(SchedulerOutput) is None:
        return exc
    if dead is not None:
        return dead
    if ctx.maybe(EngineStepOutput) is None:
        return exc
    if ctx.error is None:  # the body succeeded; only finalizers failed
        _log.error("step_finalizers_failed", step_id=ctx.step_id, error=repr(exc))
    return None


def _worker_failures(exc: BaseException) -> list[WorkerFailedError]:
    """Every WorkerFailedError in ``exc``, its causes and (nested) exception groups."""
    found: list[WorkerFailedError] = []
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, WorkerFailedError):
            found.append(current)
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                stack.append(linked)
    return found


def describe_failure(step_id: int, exc: BaseException, report: StepReport | None) -> StepFailure:
    """Which stages and finalizers failed, on which ranks, and whether it was cancelled.

    Args:
        step_id: The scheduler's id of the failed step.
        exc: What the engine graph raised.
        report: The engine graph's report of the step (``ctx.report``), if any.
    """
    stages: list[str] = []
    finalizers: list[str] = []
    ranks: list[int] = []
    cancelled = False
    if report is not None:
        if report.failed_stage:
            stages.append(report.failed_stage)
        stages.extend(
            r.name
            for r in report.stages
            if r.outcome == "cancelled" and not r.finalizer and r.name != report.failed_stage
        )
        finalizers.extend(report.finalizer_failures)
        cancelled = report.outcome == "cancelled"
    for worker in sorted(_worker_failures(exc), key=lambda w: w.rank):
        if worker.rank not in ranks:
            ranks.append(worker.rank)
        wreport = worker.report
        if isinstance(wreport, StepReport):
            if wreport.failed_stage:
                stages.append(f"rank{worker.rank}:{wreport.failed_stage}")
            finalizers.extend(f"rank{worker.rank}:{name}" for name in wreport.finalizer_failures)
            cancelled = cancelled or wreport.outcome == "cancelled"
        else:
            cancelled = True  # no report: the rank never answered (deadline)
    if isinstance(exc, StepCancelledError):
        cancelled = True
    return StepFailure(
        step_id=step_id,
        failed_stages=tuple(stages),
        failed_finalizers=tuple(finalizers),
        ranks=tuple(ranks),
        cancelled=cancelled,
        message=repr(exc),
    )


@attrs.frozen
class FailStepStage(Finalizer):
    """Fails the requests of a step whose body failed; a no-op after a step that succeeded.

    In order, in its synchronous ``finalize`` (no drain), reading with ``ctx.maybe``:

    1. hands the aggregator the transfer reports of the ranks that did answer in a step
       ``execute`` failed (:class:`~stages.execute.AnsweredRanks`): their connectors
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
    of the step (:class:`~pipeline.errors.StepCancelledError`). Idempotent (its own
    flag in ``ctx.scratch``). Not mandatory: a graph that replaces it chooses its own
    failure policy; a graph without it makes :meth:`EngineCore.step` raise the step's
    error.
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
        answered = ctx.maybe(AnsweredRanks)
        if answered is not None:
            self.aggregator.record(answered.step_id, answered.outputs)
        if scheduler_output is None or self.executor.failure is not None:
            return
        if ctx.cancelled:
            if cancelled_from_outside():
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
