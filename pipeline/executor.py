"""Executors: run one worker step on every rank and hand fan-in one awaitable per rank.

Three backends implement :class:`Executor`: :class:`InProcessExecutor` (virtual ranks in
this process, each with the whole model), :class:`~pipeline.multiproc.MultiprocExecutor`
(a worker process per rank, tensor-parallel) and :class:`~pipeline.ray_executor.RayExecutor`
(Ray actors, tensor-parallel, for more than one machine).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Protocol

import anyio

from connectors.base import ModelFingerprint
from pipeline.artifacts import PendingWorkerOutputs, SchedulerOutput, WorkerOutput
from pipeline.errors import WorkerDiedError, WorkerFailedError
from pipeline.worker import Worker

__all__ = ["Executor", "InProcessExecutor", "RemoteExecutor"]


class Executor(Protocol):
    """What the engine needs of an executor.

    ``submit`` starts one step on every rank and returns one zero-argument awaitable per
    rank, which fan-in awaits (and may cancel) under its deadline. ``failure`` is set
    (and ``check_alive`` returns it) once a rank is gone for good: the engine is then
    dead. ``bound_metadata`` counts ranks whose connector metadata is still bound (the
    leak check). ``shutdown`` releases every rank; idempotent.
    """

    name: str
    failure: WorkerDiedError | None

    @property
    def world_size(self) -> int: ...

    def submit(self, scheduler_output: SchedulerOutput) -> PendingWorkerOutputs: ...

    def check_alive(self) -> WorkerDiedError | None: ...

    def bound_metadata(self) -> int: ...

    async def shutdown(self) -> None: ...


class RemoteExecutor(Executor, Protocol):
    """An executor whose ranks load the model themselves (worker processes, Ray actors).

    ``fingerprint`` is rank 0's (the scheduler-side connector's keys) and ``num_blocks``
    the smallest KV cache among the ranks, both from the ranks' ``Ready``. ``kill``
    stops every rank at once (failure paths; no graceful shutdown).
    """

    fingerprint: ModelFingerprint
    num_blocks: int

    def kill(self) -> None: ...


async def _rank_step(worker: Worker, scheduler_output: SchedulerOutput) -> WorkerOutput:
    """One rank's step, as fan-in's task for that rank runs it.

    A cancellation from an enclosing cancel scope (fan-in's deadline or task group, the
    engine closing) propagates. A native ``task.cancel()`` of the rank's task that no
    scope asked for (no enclosing scope is cancelled) would otherwise end the task
    quietly: anyio's task group swallows it and fan-in would merge without this rank.
    It becomes a :class:`WorkerFailedError` naming the rank instead.
    """
    try:
        return await worker.step(scheduler_output)
    except anyio.get_cancelled_exc_class() as exc:
        if anyio.current_effective_deadline() == -math.inf:
            raise
        raise WorkerFailedError(
            worker.rank,
            scheduler_output.step_id,
            "its task was cancelled (task.cancel()) before it produced an output",
        ) from exc


class InProcessExecutor:
    """N virtual ranks in this process, each an anyio task started by fan-in.

    ``submit`` returns lazy waiters: fan-in awaits them inside its own task group, so a
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

    def submit(self, scheduler_output: SchedulerOutput) -> PendingWorkerOutputs:
        waiters: list[Callable[[], Awaitable[WorkerOutput]]] = [
            partial(_rank_step, worker, scheduler_output) for worker in self.workers
        ]
        return PendingWorkerOutputs(step_id=scheduler_output.step_id, waiters=tuple(waiters))

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
