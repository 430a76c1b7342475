"""What the executors whose ranks live outside the engine's process share.

What such ranks need is sent as data: the configuration, the import path of a custom
worker graph function, and the import paths of the connector's classes (so a connector
registered in the engine's process is registered in the workers too). The ``multiproc``
and ``ray`` executors build their ``Init`` messages, check ``Ready`` and settle step
replies here; which of them starts is :data:`~pipeline.executors.backends.BACKENDS`'
choice, so this module imports neither.
"""

from __future__ import annotations

import os
import tempfile

import attrs

from connectors.registry import get_connector
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError, WorkerFailedError
from pipeline.executors import wire
from pipeline.executors.workdirs import make_workdir, sweep_stale_workdirs
from pipeline.imports import import_path
from pipeline.steplog import StepLog
from stages.model.shm_allreduce import available, region_bytes, slot_bytes

__all__ = [
    "check_ready",
    "connector_import_paths",
    "init_message",
    "plan_workdir",
    "rank_device",
    "settle_reply",
]


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


def _shm_slot_bytes(config: EngineConfig) -> int:
    """Slot size of the shared-memory all-reduce (0: not offered on this machine)."""
    from stages.model.builtin import resolve_model_path
    from stages.model.config import load_model_config
    from stages.model.runner_parts import resolve_dtype

    if not available():
        return 0
    import torch

    model = load_model_config(resolve_model_path(config.model))
    elem = resolve_dtype(config.dtype, torch.device("cpu"), model.torch_dtype).itemsize
    return slot_bytes(config.max_num_batched_tokens, model.hidden_size, elem)


def _workdir(shared_bytes: int) -> tuple[str, str | None]:
    """A private directory for the rendezvous and the all-reduce file, and that file.

    On tmpfs (``/dev/shm``) when it has room for ``shared_bytes`` with a margin: a
    mapping past a full tmpfs would kill the workers with SIGBUS. Otherwise the default
    temporary directory; the shared file is then offered only if that has room.
    """
    shm = "/dev/shm"
    for where in (shm if os.access(shm, os.W_OK) else None, None):
        base = where or tempfile.gettempdir()
        stat = os.statvfs(base)
        free = stat.f_bavail * stat.f_frsize
        if shared_bytes and free >= 2 * shared_bytes:
            path = make_workdir(where)
            return path, f"{path}/allreduce"
    return make_workdir(None), None


def plan_workdir(config: EngineConfig, backend: str) -> tuple[str, str | None, int]:
    """The worker processes' private directory, their shared-memory all-reduce file (or
    ``None``: reduce with ``backend`` alone) and its slot size in bytes (0 without one).

    The file is offered to CPU (gloo) groups of more than one rank on x86-64, sized once
    here so that every rank maps the same layout. Removes first the directories of
    engines that are gone (:func:`~pipeline.executors.workdirs.sweep_stale_workdirs`).
    """
    sweep_stale_workdirs()
    slot = _shm_slot_bytes(config) if backend == "gloo" and config.world_size > 1 else 0
    workdir, path = _workdir(region_bytes(config.world_size, slot) if slot else 0)
    return workdir, path, slot if path is not None else 0


def init_message(
    config: EngineConfig,
    rank: int,
    *,
    device: str,
    backend: str,
    init_method: str,
    worker_graph: str | None,
    connector_classes: tuple[str, str] | None,
    shm_allreduce: str | None = None,
    shm_slot_bytes: int = 0,
) -> wire.Init:
    """Rank ``rank``'s ``Init``: the configuration as plain values (no step log path:
    workers' records come back in their replies) and where the group meets."""
    return wire.Init(
        rank=rank,
        world_size=config.world_size,
        config=attrs.asdict(attrs.evolve(config, step_log=None), recurse=False),
        device=device,
        dist_backend=backend,
        dist_init_method=init_method,
        connector_classes=connector_classes,
        worker_graph=worker_graph,
        shm_allreduce=shm_allreduce,
        shm_slot_bytes=shm_slot_bytes,
    )


def check_ready(rank: int, message: wire.Message) -> wire.Ready:
    """``message`` as rank ``rank``'s ``Ready``.

    Raises:
        WorkerFailedError: The rank failed to start (its error in the message), or sent
            something else.
    """
    if isinstance(message, wire.InitFailed):
        raise WorkerFailedError(
            rank, -1, f"failed to start: {message.error_type}: {message.message}"
        )
    if not isinstance(message, wire.Ready):
        raise WorkerFailedError(rank, -1, f"sent {type(message).__name__}, not Ready")
    return message


def settle_reply(
    rank: int, step_id: int, reply: wire.Message, step_log: StepLog
) -> wire.StepDone | wire.StepFailed:
    """Write a step reply's worker records to ``step_log`` and hand the reply back.

    Raises:
        WorkerFailedError: ``reply`` is not a step reply.
    """
    if not isinstance(reply, wire.StepDone | wire.StepFailed):
        raise WorkerFailedError(rank, step_id, f"sent {type(reply).__name__} during a step")
    for record in reply.records:
        step_log.record_step(record.report, kind="worker", **record.fields)
    return reply
