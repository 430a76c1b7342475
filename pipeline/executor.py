"""Executors: run one worker step on every rank and hand fan-in one awaitable per rank."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from pipeline.artifacts import PendingWorkerOutputs, SchedulerOutput, WorkerOutput
from pipeline.worker import Worker

__all__ = ["InProcessExecutor"]


class InProcessExecutor:
    """N virtual ranks in this process, each an anyio task started by fan-in.

    ``submit`` returns lazy waiters: fan-in awaits them inside its own task group, so a
    step that fails or times out cancels the other ranks, whose finalizers still run.
    Forward passes run on worker threads, so the event loop stays responsive.
    """

    name = "inprocess"

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = tuple(workers)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def submit(self, scheduler_output: SchedulerOutput) -> PendingWorkerOutputs:
        waiters: list[Callable[[], Awaitable[WorkerOutput]]] = [
            partial(worker.step, scheduler_output) for worker in self.workers
        ]
        return PendingWorkerOutputs(step_id=scheduler_output.step_id, waiters=tuple(waiters))

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
