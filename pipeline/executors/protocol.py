"""The executor protocols: :class:`Executor` (the one the ``execute`` stage consumes,
defined beside it in :mod:`stages.execute`) and :class:`RemoteExecutor`, which extends it
for ranks that load the model themselves.

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
from stages.execute import Executor, SubmittedStep

__all__ = ["Executor", "RemoteExecutor", "SubmittedStep"]


class RemoteExecutor(Executor, Protocol):
    """An executor whose ranks load the model themselves (worker processes, Ray actors).

    ``fingerprint`` is rank 0's (the scheduler-side connector's keys), ``num_blocks``
    the smallest KV cache among the ranks, ``linear_kernel`` what rank 0's
    projections run on and ``compiled`` whether its passes run compiled, all from the
    ranks' ``Ready``. ``kill``
    stops every rank at once (failure paths; no graceful shutdown).
    """

    fingerprint: ModelFingerprint
    num_blocks: int
    linear_kernel: str
    compiled: bool

    def kill(self) -> None: ...
