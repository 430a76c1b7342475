"""Executors: how one worker step runs on every rank.

One protocol (:class:`Executor`, and :class:`RemoteExecutor` for ranks that load the
model themselves), three backends (in-process, ``multiproc`` worker processes, Ray
actors), the table the engine starts them from (:data:`BACKENDS`), and the wire the
remote ranks speak (:mod:`~pipeline.executors.wire`, :mod:`~pipeline.executors.channel`).
A worker process runs ``python -m pipeline.executors.remote_worker``.
"""

from __future__ import annotations

from pipeline.executors.backends import BACKENDS, Backend, StartedExecutor, start_executor
from pipeline.executors.inprocess import InProcessExecutor
from pipeline.executors.multiproc import MultiprocExecutor
from pipeline.executors.protocol import Executor, RemoteExecutor
from pipeline.executors.ray import RayExecutor
from pipeline.executors.worker import Worker

__all__ = [
    "BACKENDS",
    "Backend",
    "Executor",
    "InProcessExecutor",
    "MultiprocExecutor",
    "RayExecutor",
    "RemoteExecutor",
    "StartedExecutor",
    "Worker",
    "start_executor",
]
