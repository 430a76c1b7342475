"""The table of executor backends: ``EngineConfig.executor`` names a row of
:data:`BACKENDS`, and the row starts that executor's ranks.

``inprocess`` loads one model runner per rank here and wraps them in workers;
``multiproc`` and ``ray`` start ranks that load the model themselves, and are sent what
they need as data (the worker graph's and the connector classes' import paths).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import attrs

from connectors.base import ModelFingerprint
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError
from pipeline.executors.inprocess import InProcessExecutor
from pipeline.executors.multiproc import MultiprocExecutor
from pipeline.executors.protocol import Executor, RemoteExecutor
from pipeline.executors.ray import RayExecutor
from pipeline.executors.remote import connector_import_paths
from pipeline.executors.worker import GraphArg, Worker, build_worker, graph_import_path
from pipeline.steplog import StepLog
from stages.model.builtin import resolve_model_path
from stages.model.config import ModelConfig, load_model_config
from stages.model.parallel import check_tp_divisible
from stages.model.runner import ModelRunner
from stages.model.settings import RunnerSettings

__all__ = [
    "BACKENDS",
    "Backend",
    "StartedExecutor",
    "start_executor",
    "start_inprocess",
    "start_multiproc",
    "start_ray",
]


@attrs.frozen
class StartedExecutor:
    """A started executor and what the engine learns from its ranks.

    ``fingerprint`` is rank 0's (the scheduler-side connector's keys), ``num_blocks``
    the smallest KV cache among the ranks, ``linear_kernel`` what rank 0's projections
    run on, ``compiled`` whether its passes run compiled (``torch_compile``);
    ``workers`` are the in-process ranks (empty for ranks in other processes).
    """

    executor: Executor
    model_config: ModelConfig
    fingerprint: ModelFingerprint
    num_blocks: int
    workers: tuple[Worker, ...] = ()
    linear_kernel: str = "mkl"
    compiled: bool = False


class Backend(Protocol):
    """Start ``config.world_size`` ranks; blocks until every rank is ready."""

    def __call__(
        self, config: EngineConfig, *, step_log: StepLog, worker_graph: GraphArg
    ) -> StartedExecutor: ...


def _load_runners(config: EngineConfig) -> list[ModelRunner]:
    settings = RunnerSettings.from_config(config)
    first = ModelRunner.load(settings, rank=0)
    rest = [
        ModelRunner.load(settings, rank=rank, shared_model=first)
        for rank in range(1, config.world_size)
    ]
    return [first, *rest]


def start_inprocess(
    config: EngineConfig, *, step_log: StepLog, worker_graph: GraphArg
) -> StartedExecutor:
    """``inprocess``: one runner per rank in this process (the model loaded once)."""
    runners = _load_runners(config)
    workers = tuple(
        build_worker(config, runner, rank=rank, worker_graph=worker_graph, step_log=step_log)
        for rank, runner in enumerate(runners)
    )
    first = runners[0]
    return StartedExecutor(
        InProcessExecutor(workers),
        first.model_config,
        first.fingerprint,
        first.num_blocks,
        workers,
        first.linear_kernel,
        first.compiled,
    )


def _start_remote(
    launch: type[MultiprocExecutor] | type[RayExecutor],
    config: EngineConfig,
    step_log: StepLog,
    worker_graph: GraphArg,
) -> StartedExecutor:
    model_config = load_model_config(resolve_model_path(config.model))
    check_tp_divisible(model_config, config.world_size)
    executor: RemoteExecutor = launch.launch(
        config,
        step_log=step_log,
        worker_graph=graph_import_path(worker_graph),
        connector_classes=connector_import_paths(config.connector),
    )
    return StartedExecutor(
        executor,
        model_config,
        executor.fingerprint,
        executor.num_blocks,
        linear_kernel=executor.linear_kernel,
        compiled=executor.compiled,
    )


def start_multiproc(
    config: EngineConfig, *, step_log: StepLog, worker_graph: GraphArg
) -> StartedExecutor:
    """``multiproc``: a worker process per rank (:mod:`pipeline.executors.multiproc`)."""
    return _start_remote(MultiprocExecutor, config, step_log, worker_graph)


def start_ray(
    config: EngineConfig, *, step_log: StepLog, worker_graph: GraphArg
) -> StartedExecutor:
    """``ray``: a Ray actor per rank (:mod:`pipeline.executors.ray`)."""
    return _start_remote(RayExecutor, config, step_log, worker_graph)


BACKENDS: Mapping[str, Backend] = MappingProxyType(
    {"inprocess": start_inprocess, "multiproc": start_multiproc, "ray": start_ray}
)
"""Every executor backend by its ``EngineConfig.executor`` name."""


def start_executor(
    config: EngineConfig, *, step_log: StepLog, worker_graph: GraphArg = None
) -> StartedExecutor:
    """Start ``config.executor``'s ranks; blocks until every rank is ready.

    Raises:
        InvalidConfigError: An executor not in :data:`BACKENDS`; a worker graph or
            connector that cannot cross processes, a bad device, or ``ray`` without the
            ``kvstep[ray]`` extra.
        WorkerFailedError: A rank failed to start.
    """
    backend = BACKENDS.get(config.executor)
    if backend is None:
        raise InvalidConfigError("executor", config.executor, f"must be one of {sorted(BACKENDS)}")
    return backend(config, step_log=step_log, worker_graph=worker_graph)
