"""Turn a failed step's exception and reports into one :class:`StepFailure` record."""

from __future__ import annotations

from pipeline.errors import StepCancelledError, StepFailure, WorkerFailedError
from pipeline.kernel.report import StepReport

__all__ = ["describe_failure"]


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
