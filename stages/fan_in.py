"""``fan_in``: await every rank's ``WorkerOutput`` with a deadline and merge them.

The merging itself (driver rank's tokens, unions, summed stats, per-request rank sets
with leases) is :class:`~stages.aggregator.FanInAggregator`'s; this stage awaits the
ranks concurrently and turns a rank that raises or misses the deadline into a
:class:`~pipeline.errors.WorkerFailedError` that names every failing rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import anyio
import attrs

from pipeline.artifacts import FanInOutput, PendingWorkerOutputs, WorkerOutput
from pipeline.errors import WorkerFailedError
from pipeline.kernel.context import StepContext
from stages.aggregator import FanInAggregator

__all__ = ["FanInAggregator", "FanInStage"]


def _combine(step_id: int, failures: Sequence[WorkerFailedError]) -> WorkerFailedError:
    """One error for the step that names every failing rank (lowest rank first).

    With one failure that failure is returned as is. With several, a new error carries
    the lowest rank and its report, and a message naming every rank and its reason; the
    other ranks' errors (and the first one's cause) are chained as an exception group in
    ``__cause__``, where :func:`pipeline.kernel.failure.describe_failure` finds them.
    """
    ordered = sorted(failures, key=lambda f: f.rank)
    if len(ordered) == 1:
        return ordered[0]
    first, rest = ordered[0], ordered[1:]
    ranks = ", ".join(str(f.rank) for f in ordered)
    also = "; ".join(f"rank {f.rank}: {f.reason}" for f in rest)
    combined = WorkerFailedError(
        first.rank, step_id, f"{first.reason}; also failed: {also}", report=first.report
    )
    chained: list[Exception] = list(rest)
    if isinstance(first.__cause__, Exception):
        chained.insert(0, first.__cause__)
    combined.__cause__ = ExceptionGroup(f"step {step_id}: worker ranks {ranks} failed", chained)
    return combined


def _worker_failures(group: BaseExceptionGroup) -> list[WorkerFailedError] | None:
    """The WorkerFailedErrors of a task-group error, or ``None`` if it holds others."""
    found: list[WorkerFailedError] = []
    for exc in group.exceptions:
        if isinstance(exc, WorkerFailedError):
            found.append(exc)
        elif isinstance(exc, BaseExceptionGroup):
            nested = _worker_failures(exc)
            if nested is None:
                return None
            found.extend(nested)
        else:
            return None
    return found


@attrs.frozen
class FanInStage:
    """Awaits all ranks concurrently under ``timeout_s``; a failing rank fails the step.

    Rank 0 runs in the current task and ranks 1..N-1 as tasks of one task group (one
    rank: no task group at all). Each rank's worker graph runs its own finalizers
    whether or not another rank fails: when one raises, the task group cancels the
    others, whose ``clear`` still runs.

    When the step fails, the transfer reports of the ranks that did answer are still
    recorded (:meth:`FanInAggregator.record`): their connectors will not repeat them.

    Cancellation-safe: cancelling the step cancels every rank's task (each runs its
    finalizers) and re-raises.

    Raises:
        WorkerFailedError: A rank raised, or gave no output within ``timeout_s``. With
            several failing ranks, the message names each one and the others' errors
            are chained in ``__cause__``.
    """

    name: ClassVar[str] = "fan_in"
    requires: ClassVar[tuple[type, ...]] = (PendingWorkerOutputs,)
    provides: ClassVar[type] = FanInOutput

    aggregator: FanInAggregator
    timeout_s: float = 300.0

    async def run(self, ctx: StepContext) -> FanInOutput:
        pending = ctx.get(PendingWorkerOutputs)
        step_id = pending.step_id
        results: list[WorkerOutput | None] = [None] * len(pending.waiters)

        async def collect(rank: int) -> None:
            try:
                results[rank] = await pending.waiters[rank]()
            except (anyio.get_cancelled_exc_class(), WorkerFailedError):
                raise
            except Exception as exc:
                raise WorkerFailedError(rank, step_id, repr(exc)) from exc

        num_ranks = len(pending.waiters)
        error: WorkerFailedError | None = None
        try:
            with anyio.fail_after(self.timeout_s):
                if num_ranks == 1:
                    await collect(0)  # no task group: nothing else to cancel
                elif num_ranks > 1:
                    async with anyio.create_task_group() as tg:
                        for rank in range(1, num_ranks):
                            tg.start_soon(collect, rank, name=f"kvstep-rank{rank}")
                        await collect(0)  # the driver rank in this task: one spawn less
        except TimeoutError:
            missing = [rank for rank, out in enumerate(results) if out is None]
            reason = f"no output within the fan-in deadline of {self.timeout_s}s"
            error = _combine(step_id, [WorkerFailedError(r, step_id, reason) for r in missing])
        except WorkerFailedError as exc:
            error = exc
        except BaseExceptionGroup as group:
            failures = _worker_failures(group)
            if not failures:
                self.aggregator.record(step_id, [out for out in results if out is not None])
                raise
            error = _combine(step_id, failures)
        answered = [out for out in results if out is not None]
        if error is not None:
            # Raised outside the handler so that the failures are chained only once
            # (``__cause__``), never again as ``__context__``.
            self.aggregator.record(step_id, answered)
            raise error
        merged = self.aggregator.merge(step_id, answered)
        if not pending.request_errors:
            return merged
        return attrs.evolve(
            merged, request_errors={**pending.request_errors, **merged.request_errors}
        )
