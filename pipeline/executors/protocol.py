"""The executor protocol: run one worker step on every rank and hand fan-in one
awaitable per rank.

Three backends implement :class:`Executor`:
:class:`~pipeline.executors.inprocess.InProcessExecutor` (virtual ranks in this process,
each with the whole model), :class:`~pipeline.executors.multiproc.MultiprocExecutor` (a
worker process per rank, tensor-parallel) and :class:`~pipeline.executors.ray.RayExecutor`
(Ray actors, tensor-parallel, for more than one machine); the table of them is
:data:`~pipeline.executors.backends.BACKENDS`.
"""

from __future__ import annotations

from typing import Protocol

from connectors.base import ModelFingerprint
from pipeline.artifacts import PendingWorkerOutputs, SchedulerOutput
from pipeline.errors import WorkerDiedError

__all__ = ["Executor", "RemoteExecutor"]


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
