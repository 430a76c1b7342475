"""``inprocess``: N virtual ranks in the engine's process, each with the whole model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import anyio

from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.errors import WorkerDiedError, WorkerFailedError
from pipeline.executors.worker import Worker
from stages.execute import SubmittedStep
from stages.fail_step import cancelled_from_outside

__all__ = ["InProcessExecutor"]


async def _rank_step(worker: Worker, scheduler_output: SchedulerOutput) -> WorkerOutput:
    """One rank's step, as the ``execute`` stage's task for that rank runs it.

    A cancellation from an enclosing cancel scope (execute's deadline or task group, the
    engine closing) propagates. A native ``task.cancel()`` of the rank's task that no
    scope asked for (:func:`~stages.fail_step.cancelled_from_outside` is false) would
    otherwise end the task quietly: anyio's task group swallows it and execute would
    return without this rank. It becomes a :class:`WorkerFailedError` naming the rank
    instead (:mod:`stages.fail_step`, row 3).
    """
    try:
        return await worker.step(scheduler_output)
    except anyio.get_cancelled_exc_class() as exc:
        if cancelled_from_outside():
            raise
        raise WorkerFailedError(
            worker.rank,
            scheduler_output.step_id,
            "its task was cancelled (task.cancel()) before it produced an output",
        ) from exc


class InProcessExecutor:
    """N virtual ranks in this process, each an anyio task started by ``execute``.

    ``submit`` returns lazy waiters: execute awaits them inside its own task group, so a
    step that fails or times out cancels the other ranks, whose finalizers still run.
    Forward passes run on worker threads, so the event loop stays responsive.
    """

    name = "inprocess"

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = tuple(workers)
        self.failure: WorkerDiedError | None = None  # in-process ranks cannot die alone

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def submit(self, scheduler_output: SchedulerOutput) -> SubmittedStep:
        waiters: list[Callable[[], Awaitable[WorkerOutput]]] = [
            partial(_rank_step, worker, scheduler_output) for worker in self.workers
        ]
        return SubmittedStep(tuple(waiters))

    def check_alive(self) -> WorkerDiedError | None:
        return None

    def bound_metadata(self) -> int:
        return sum(
            1
            for w in self.workers
            if w.connector is not None and w.connector.connector_metadata is not None
        )

    async def shutdown(self) -> None:
        """Close every worker; each is closed even if another fails."""
        errors: list[BaseException] = []
        for worker in self.workers:
            try:
                await worker.aclose()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
