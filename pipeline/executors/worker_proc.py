"""The main program of one worker process: ``python -m pipeline.executors.worker_proc --fd N``.

The engine starts one per rank (:class:`~pipeline.executors.multiproc.MultiprocExecutor`) with one
end of a socket pair as file descriptor ``N``. The worker reads its :class:`Init`,
binds its ``rank`` into every log event, joins the tensor-parallel group,
loads its shard of the model, builds its connector half and worker graph, answers
``Ready``, then runs steps until ``Shutdown`` or until the engine's end of the socket
closes (the engine is gone: the worker exits rather than linger).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Any

import anyio
import structlog

from pipeline.config import EngineConfig
from pipeline.executors import wire
from pipeline.executors.channel import Channel, PeerGone
from pipeline.executors.worker import Worker
from pipeline.executors.worker_factory import build_worker
from pipeline.executors.worker_steps import (
    MetadataTypes,
    Records,
    answer,
    connector_metadata_types,
    run_step,
)
from pipeline.imports import resolve_import_path
from pipeline.logs import LOG_LEVEL_ENV, configure_cli_logging, get_logger
from pipeline.steplog import StepLog

__all__ = ["Records", "bind_worker_context", "main", "run_step", "serve", "start"]

_log = get_logger()
INIT_TIMEOUT_S = 120.0
DIST_MIN_TIMEOUT_S = 30.0


def bind_worker_context(rank: int) -> None:
    """Bind ``rank`` and ``pid`` into structlog's contextvars for every event of this process.

    Every kvstep event of the worker then carries them (:mod:`pipeline.logs` merges
    structlog's contextvars into its stdlib records too), so each line names its rank.
    """
    structlog.contextvars.bind_contextvars(rank=rank, pid=os.getpid())


def _configure_logging() -> None:
    """Worker logging: none (silent, as its parent's library) unless the CLI asked for it.

    A worker is a process of its own, so its events cannot reach the application's
    handlers; its failures reach the engine as step errors. When the engine runs under
    kvstep's CLI, ``KVSTEP_LOG_LEVEL`` is in the environment the worker inherited and it
    writes its events at that level to stderr (shared with the CLI) like the CLI does.
    """
    level = os.environ.get(LOG_LEVEL_ENV)
    if level and isinstance(logging.getLevelName(level.upper()), int):
        configure_cli_logging(logging.getLevelName(level.upper()), prefix="kvstep worker")


def _register_connector(name: str, classes: tuple[str, str]) -> None:
    from connectors.registry import get_connector, list_connectors, register_connector

    if name in list_connectors():
        return
    try:
        get_connector(name)  # a built-in, imported lazily
        return
    except KeyError:
        pass
    scheduler_cls = resolve_import_path(classes[0], what="connector scheduler class")
    worker_cls = resolve_import_path(classes[1], what="connector worker class")
    register_connector(name, scheduler_cls, worker_cls)


def _cpu_threads(world_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _shared_memory_reduce(init: wire.Init, config: EngineConfig, tp: Any) -> Any:
    """``tp`` summing through the shared file the engine planned (gloo beyond a slot)."""
    import attrs

    from stages.forward.shm_allreduce import SharedMemoryAllReduce

    if init.shm_allreduce is None or init.shm_slot_bytes <= 0:
        return tp
    reduce = SharedMemoryAllReduce(
        init.shm_allreduce,
        rank=init.rank,
        size=init.world_size,
        slot_bytes=init.shm_slot_bytes,
        fallback=tp.all_reduce,
        timeout_s=max(config.fan_in_timeout_s, DIST_MIN_TIMEOUT_S),
    )
    return attrs.evolve(tp, all_reduce=reduce)


def start(init: wire.Init, records: Records) -> Worker:
    """Join the group, load this rank's shard, build its worker. Blocks for the load."""
    import torch

    from stages.forward.parallel import init_process_group
    from stages.forward.runner import ModelRunner
    from stages.forward.spec import RunnerSpec

    config = EngineConfig(**init.config)
    if init.device == "cpu":
        torch.set_num_threads(_cpu_threads(init.world_size))
    tp = init_process_group(
        backend=init.dist_backend,
        init_method=init.dist_init_method,
        rank=init.rank,
        world_size=init.world_size,
        # Bounds the rendezvous and every collective; never shorter than DIST_MIN_TIMEOUT_S
        # so that a short fan-in deadline cannot fail a slow start.
        timeout_s=max(config.fan_in_timeout_s, DIST_MIN_TIMEOUT_S),
    )
    tp = _shared_memory_reduce(init, config, tp)
    if config.connector is not None and init.connector_classes is not None:
        _register_connector(config.connector, init.connector_classes)
    spec = RunnerSpec.from_config(config, device=init.device)
    runner = ModelRunner.load(spec, rank=init.rank, tp=tp)
    step_log = StepLog(None)
    step_log.listeners.append(records)
    try:
        return build_worker(
            config, runner, rank=init.rank, worker_graph=init.worker_graph, step_log=step_log
        )
    except BaseException:
        runner.close()
        raise


async def serve(
    channel: Channel,
    worker: Worker,
    records: Records,
    timeout_s: float,
    metadata_types: MetadataTypes | None = None,
) -> None:
    """Run steps until ``Shutdown``, a fatal step, or until the engine's end closes.

    A frame that does not decode, or a reply that does not encode, fails its step
    (:func:`pipeline.executors.worker_steps.answer`); the worker keeps serving.
    """
    while True:
        try:
            body = await channel.recv_frame()
        except PeerGone:
            _log.warning("engine_gone")
            return
        result = await answer(worker, body, records, timeout_s, metadata_types)
        if result.reply is not None:
            await channel.send(result.reply)
        if result.stop:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.executors.worker_proc")
    parser.add_argument("--fd", type=int, required=True, help="socket to the engine")
    args = parser.parse_args(argv)
    _configure_logging()
    # Ctrl-C in a terminal reaches the whole process group: the engine owns this
    # worker's lifetime (Shutdown, or its end of the socket closing), not the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=args.fd), peer="engine")
    message = channel.recv_sync(timeout_s=INIT_TIMEOUT_S)
    if not isinstance(message, wire.Init):
        raise SystemExit(f"expected Init, got {type(message).__name__}")
    init = message
    bind_worker_context(init.rank)
    records = Records()
    try:
        worker = start(init, records)
    except Exception as exc:
        _log.error("worker_start_failed", error=repr(exc))
        channel.send_sync(wire.InitFailed(init.rank, type(exc).__name__, str(exc)))
        return 1
    fingerprint = worker.runner.fingerprint
    channel.send_sync(wire.Ready(init.rank, os.getpid(), worker.runner.num_blocks, fingerprint))
    _log.info("worker_ready", num_blocks=worker.runner.num_blocks, device=init.device)

    async def run() -> None:
        try:
            config = EngineConfig(**init.config)
            types = connector_metadata_types(config.connector)
            await serve(channel, worker, records, config.fan_in_timeout_s, types)
        finally:
            with anyio.CancelScope(shield=True):
                await worker.aclose()

    try:
        anyio.run(run)
    finally:
        from stages.forward.parallel import destroy_process_group

        destroy_process_group()
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
