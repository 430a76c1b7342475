"""Starting an executor whose ranks live outside the engine's process.

What such ranks need is sent as data: the configuration, the import path of a custom
worker graph function, and the import paths of the connector's classes (so a connector
registered in the engine's process is registered in the workers too).
"""

from __future__ import annotations

from connectors.registry import get_connector
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError
from pipeline.executor import RemoteExecutor
from pipeline.imports import import_path
from pipeline.steplog import StepLog
from pipeline.worker_factory import GraphArg, graph_import_path

__all__ = ["connector_import_paths", "launch_executor", "rank_device"]


def connector_import_paths(name: str | None) -> tuple[str, str] | None:
    """Import paths of connector ``name``'s scheduler and worker classes.

    Raises:
        UnknownConnectorError: ``name`` is not registered.
        InvalidConfigError: A class another process cannot import (defined in
            ``__main__`` or inside a function).
    """
    if name is None:
        return None
    spec = get_connector(name)
    return (
        import_path(spec.scheduler_cls, what=f"connector {name!r} scheduler class"),
        import_path(spec.worker_cls, what=f"connector {name!r} worker class"),
    )


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: the CPU for every rank, or CUDA device ``base + rank``.

    Raises:
        InvalidConfigError: CUDA asked for but unavailable, or too few devices.
    """
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    base = int(device.partition(":")[2] or 0) if device.startswith("cuda") else 0
    count = torch.cuda.device_count()
    if base + rank >= count:
        raise InvalidConfigError(
            "device", device, f"rank {rank} needs cuda:{base + rank}, but {count} are visible"
        )
    return f"cuda:{base + rank}"


def launch_executor(
    config: EngineConfig, step_log: StepLog, worker_graph: GraphArg
) -> RemoteExecutor:
    """Start ``config.executor``'s ranks (``multiproc`` or ``ray``); blocks until ready.

    Raises:
        InvalidConfigError: A worker graph or connector that cannot cross processes, a
            bad device, or ``ray`` without the ``kvstep[ray]`` extra.
        WorkerFailedError: A rank failed to start.
    """
    graph_path = graph_import_path(worker_graph)
    classes = connector_import_paths(config.connector)
    if config.executor == "ray":
        from pipeline.ray_executor import RayExecutor

        return RayExecutor.launch(
            config, step_log=step_log, worker_graph=graph_path, connector_classes=classes
        )
    from pipeline.multiproc import MultiprocExecutor

    return MultiprocExecutor.launch(
        config, step_log=step_log, worker_graph=graph_path, connector_classes=classes
    )
