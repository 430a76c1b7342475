"""``execute``: run one worker step on every rank, concurrently, under the deadline.

The stage hands the ``SchedulerOutput`` to the :class:`Executor`, which starts the step
on its ranks and hands back one awaitable per rank (:class:`SubmittedStep`); the stage
awaits them all under ``timeout_s`` and returns their outputs as
:class:`~pipeline.artifacts.RankOutputs`. ``fan_in`` then only merges them. A rank that
raises or misses the deadline fails the step with a
:class:`~pipeline.errors.WorkerFailedError` naming every failing rank; the other ranks'
worker graphs have run their finalizers by then.

:class:`Executor` is the one executor protocol: the engine's backends
(:mod:`pipeline.executors`) implement it, and
:class:`~pipeline.executors.protocol.RemoteExecutor` extends it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import ClassVar, NamedTuple, Protocol

import anyio
import attrs

from pipeline.artifacts import RankOutputs, SchedulerOutput, WorkerOutput
from pipeline.errors import WorkerDiedError, WorkerFailedError
from pipeline.kernel.context import StepContext

__all__ = ["AnsweredRanks", "ExecuteStage", "Executor", "SubmittedStep", "answered_outputs"]


@attrs.frozen(kw_only=True)
class AnsweredRanks:
    """The outputs of the ranks that did answer in a step ``execute`` failed.

    ``execute`` leaves it in the step's context (``ctx.put``) when some ranks raised or
    missed the deadline (not when the step was cancelled, nor when every rank answered);
    the engine's failure finalizer reads it with ``ctx.maybe(AnsweredRanks)`` and hands
    their transfer reports to the aggregator, since those ranks' connectors will not
    repeat them (:mod:`stages.fail_step`).

    Attributes:
        step_id: The step.
        outputs: The answering ranks' outputs, in rank order.
    """

    step_id: int
    outputs: tuple[WorkerOutput, ...]


class SubmittedStep(NamedTuple):
    """One step handed to an executor: what ``execute`` awaits.

    Attributes:
        ranks: One zero-argument async callable per rank, in rank order, returning that
            rank's ``WorkerOutput``. ``execute`` calls each once, concurrently, and may
            cancel it (deadline, another rank failing); it must then run the rank's
            finalizers (or leave the rank able to run its next step).
        request_errors: Requests the executor left out of the step because they could
            not be sent to the workers (e.g. not encodable), with why; each fails alone.
    """

    ranks: tuple[Callable[[], Awaitable[WorkerOutput]], ...]
    request_errors: Mapping[str, str] = {}


class Executor(Protocol):
    """What the engine needs of an executor (in-process, worker processes, Ray actors).

    ``submit`` starts one step on every rank (it may send it there) and returns one
    awaitable per rank, which ``execute`` awaits (and may cancel) under its deadline;
    called once per step on the event loop, must not block. ``failure`` is set (and
    ``check_alive`` returns it) once a rank is gone for good: the engine is then dead.
    ``bound_metadata`` counts ranks whose connector metadata is still bound (the leak
    check). ``shutdown`` releases every rank; idempotent.
    """

    name: str
    failure: WorkerDiedError | None

    @property
    def world_size(self) -> int: ...

    def submit(self, scheduler_output: SchedulerOutput) -> SubmittedStep: ...

    def check_alive(self) -> WorkerDiedError | None: ...

    def bound_metadata(self) -> int: ...

    async def shutdown(self) -> None: ...


def answered_outputs(ctx: StepContext) -> tuple[WorkerOutput, ...] | None:
    """The outputs of the ranks that did answer in a step ``execute`` failed, or ``None``
    (:class:`AnsweredRanks`)."""
    answered = ctx.maybe(AnsweredRanks)
    return None if answered is None else answered.outputs


def _answered(step_id: int, results: Sequence[WorkerOutput | None]) -> AnsweredRanks:
    return AnsweredRanks(step_id=step_id, outputs=tuple(o for o in results if o is not None))


def _combine(step_id: int, failures: Sequence[WorkerFailedError]) -> WorkerFailedError:
    """One error for the step that names every failing rank (lowest rank first).

    With one failure that failure is returned as is. With several, a new error carries
    the lowest rank and its report, and a message naming every rank and its reason; the
    other ranks' errors (and the first one's cause) are chained as an exception group in
    ``__cause__``, where :func:`stages.fail_step.describe_failure` finds them.
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
class ExecuteStage:
    """Runs every rank's step through the executor, concurrently, under ``timeout_s``.

    Rank 0 runs in the current task and ranks 1..N-1 as tasks of one task group (one
    rank: no task group at all). Each rank's worker graph runs its own finalizers
    whether or not another rank fails: when one raises, the task group cancels the
    others, whose ``clear`` still runs.

    When the step fails, the outputs of the ranks that did answer are left in the
    context as :class:`AnsweredRanks` for the engine's failure finalizer, which records
    their transfer reports: their connectors will not repeat them.

    Cancellation-safe: cancelling the step cancels every rank's task (each runs its
    finalizers) and re-raises.

    Raises:
        WorkerFailedError: A rank raised, or gave no output within ``timeout_s``. With
            several failing ranks, the message names each one and the others' errors
            are chained in ``__cause__``.
    """

    name: ClassVar[str] = "execute"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput,)
    provides: ClassVar[type] = RankOutputs

    executor: Executor
    timeout_s: float = 300.0

    async def run(self, ctx: StepContext) -> RankOutputs:
        scheduler_output = ctx.get(SchedulerOutput)
        step_id = scheduler_output.step_id
        submitted = self.executor.submit(scheduler_output)
        steps = submitted.ranks
        results: list[WorkerOutput | None] = [None] * len(steps)

        async def collect(rank: int) -> None:
            try:
                results[rank] = await steps[rank]()
            except (anyio.get_cancelled_exc_class(), WorkerFailedError):
                raise
            except Exception as exc:
                raise WorkerFailedError(rank, step_id, repr(exc)) from exc

        num_ranks = len(steps)
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
                ctx.put(_answered(step_id, results))
                raise
            error = _combine(step_id, failures)
        if error is not None:
            # Raised outside the handler so that the failures are chained only once
            # (``__cause__``), never again as ``__context__``.
            ctx.put(_answered(step_id, results))
            raise error
        return RankOutputs(
            step_id=step_id,
            outputs=tuple(out for out in results if out is not None),
            request_errors=dict(submitted.request_errors),
        )
