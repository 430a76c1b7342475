"""A rank outside the engine's process: a ``multiproc`` worker process or a Ray actor.

Both start their rank with :func:`start` and answer each step frame with :func:`answer`;
the Ray actor is :mod:`pipeline.executors.ray_actor`. The engine's side of such ranks
(their ``Init`` messages, ``Ready`` checks and step replies) is
:mod:`pipeline.executors.remote`.

**The worker process** (``python -m pipeline.executors.remote_worker --fd N``): the engine
starts one per rank (:class:`~pipeline.executors.multiproc.MultiprocExecutor`) with one
end of a socket pair as file descriptor ``N``. The worker reads its :class:`Init`,
binds its ``rank`` into every log event, joins the tensor-parallel group,
loads its shard of the model, builds its connector half and worker graph, answers
``Ready``, then runs steps until ``Shutdown`` or until the engine's end of the socket
closes (the engine is gone: the worker exits rather than linger).

**Answering one step frame.** Every frame gets exactly one reply and no frame kills the
worker:

* a frame that does not decode as a ``Step`` (a field the typed decoder rejects: a
  ``bool`` where a number is meant, an out-of-range integer) is answered with a
  non-fatal ``StepFailed`` for the step it names (:func:`pipeline.executors.wire.recover_step_id`).
  Non-fatal even on a tensor-parallel rank: the engine encodes a step once and sends
  every rank the identical bytes, the decoder is deterministic, so every rank refuses
  the frame before any collective and the group stays in step;
* a frame that does not even name a step (not a ``Step`` at all) is a protocol
  violation: it is logged and answered with ``StepFailed`` for step ``-1``, which the
  engine cannot match to the step it waits for, so that step fails at the fan-in
  deadline while the worker keeps serving;
* a reply that cannot be encoded (a value msgspec refuses) becomes a ``StepFailed`` of
  that step carrying why (non-fatal unless the reply was fatal already).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import anyio
import structlog

from connectors.base import KVConnectorMetadata
from pipeline.config import EngineConfig
from pipeline.errors import TransportError, WorkerFailedError, short_repr
from pipeline.executors import wire
from pipeline.executors.channel import Channel, PeerGone
from pipeline.executors.wire_checks import metadata_types
from pipeline.executors.worker import Worker, build_worker
from pipeline.imports import resolve_import_path
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StepReport
from pipeline.kernel.stage import is_collective
from pipeline.logger import LOG_LEVEL_ENV, configure_cli_logging, get_logger
from pipeline.steplog import StepLog

__all__ = [
    "Answer",
    "MetadataTypes",
    "Records",
    "answer",
    "bind_worker_context",
    "breaks_group",
    "collective_stages",
    "connector_metadata_types",
    "encode_reply",
    "main",
    "run_step",
    "serve",
    "start",
]

_log = get_logger()
_REASON_CHARS = 500
INIT_TIMEOUT_S = 120.0
DIST_MIN_TIMEOUT_S = 30.0

MetadataTypes = Mapping[str, type[KVConnectorMetadata]]


class Records:
    """A step-log listener that keeps this step's records for the reply."""

    def __init__(self) -> None:
        self.items: list[wire.WorkerRecord] = []

    def __call__(self, report: StepReport, kind: str, fields: dict[str, Any]) -> None:
        self.items.append(wire.WorkerRecord(report=report, fields=dict(fields)))

    def take(self) -> list[wire.WorkerRecord]:
        items, self.items = self.items, []
        return items


class Answer(NamedTuple):
    """What to do with one frame: the reply to send (``None``: none) and whether to stop."""

    reply: bytes | None
    stop: bool


def connector_metadata_types(name: str | None) -> dict[str, type[KVConnectorMetadata]]:
    """The metadata classes a worker of connector ``name`` accepts (its allow-list).

    Call it after the connector is registered in this process.
    """
    if name is None:
        return {}
    from connectors.registry import get_connector

    spec = get_connector(name)
    return metadata_types(spec.scheduler_cls, spec.worker_cls)


async def answer(
    worker: Worker,
    body: bytes,
    records: Records,
    timeout_s: float,
    metadata_types: MetadataTypes | None = None,
) -> Answer:
    """Decode one frame from the engine, run it, and encode the reply; never raises for
    a bad frame or reply (see the module docstring).

    Returns:
        ``Answer(None, True)`` for ``Shutdown``; otherwise the encoded reply, with
        ``stop`` set when the step failed fatally (the worker must exit).
    """
    try:
        message = wire.decode(body)
    except TransportError as exc:
        return Answer(_refuse(worker, body, f"step could not be decoded: {exc}"), False)
    if isinstance(message, wire.Shutdown):
        return Answer(None, True)
    if not isinstance(message, wire.Step):
        reason = f"got {type(message).__name__} where a Step was expected"
        return Answer(_refuse(worker, body, reason), False)
    reply = await run_step(worker, message, records, timeout_s, metadata_types)
    fatal = isinstance(reply, wire.StepFailed) and reply.fatal
    return Answer(encode_reply(worker, reply), fatal)


def _refuse(worker: Worker, body: bytes, reason: str) -> bytes:
    step_id = wire.recover_step_id(body)
    if step_id is None:
        _log.error("protocol_violation", reason=reason[:_REASON_CHARS], bytes=len(body))
        step_id = -1
    else:
        _log.error("step_refused", step_id=step_id, reason=reason[:_REASON_CHARS])
    failed = wire.StepFailed(worker.rank, step_id, reason[:_REASON_CHARS], None, [], _bound(worker))
    return encode_reply(worker, failed)


def encode_reply(worker: Worker, reply: wire.StepDone | wire.StepFailed) -> bytes:
    """``reply`` encoded; one that cannot be becomes a ``StepFailed`` of its step."""
    try:
        return wire.encode(reply)
    except TransportError as exc:
        step_id = reply.output.step_id if isinstance(reply, wire.StepDone) else reply.step_id
        fatal = isinstance(reply, wire.StepFailed) and reply.fatal
        _log.error("reply_not_encodable", step_id=step_id, error=short_repr(exc, 300))
        return wire.encode(
            wire.StepFailed(
                worker.rank,
                step_id,
                f"the worker's reply could not be encoded: {short_repr(exc, 300)}",
                None,
                [],
                reply.metadata_bound,
                fatal=fatal,
            )
        )


async def run_step(
    worker: Worker,
    message: wire.Step,
    records: Records,
    timeout_s: float,
    metadata_types: MetadataTypes | None = None,
) -> wire.StepDone | wire.StepFailed:
    """Run one step under the fan-in deadline; every failure becomes a ``StepFailed``.

    On a sharded rank (tensor parallelism), a step in which a stage that declares
    collectives (``collective = True``, e.g. ``forward``) did not complete is ``fatal``
    (:func:`breaks_group`): the other ranks may be waiting in, or past, a collective
    this rank never reached, and the next step's collectives would pair with the wrong
    tensors. A failure once every collective stage completed (sample, save, finished, a
    connector's save) leaves the group in step and fails only the step. Metadata that is refused
    (``metadata_types``, the allow-list, or its ``from_bytes``) fails the step, not
    fatally: every rank got the same bytes and refuses them before any collective.
    """
    step_id = message.scheduler_output.step_id
    report: StepReport | None = None
    try:
        scheduler_output = wire.decode_metadata(message, metadata_types)
    except TransportError as exc:  # identical on every rank, before any collective
        _log.error("metadata_refused", step_id=step_id, reason=str(exc)[:_REASON_CHARS])
        return wire.StepFailed(worker.rank, step_id, repr(exc), None, [], _bound(worker))
    try:
        with anyio.fail_after(timeout_s):
            output = await worker.step(scheduler_output)
    except WorkerFailedError as exc:
        report = exc.report if isinstance(exc.report, StepReport) else None
        reason = exc.reason
    except TimeoutError:
        reason = f"no output within the fan-in deadline of {timeout_s}s"
    except Exception as exc:
        reason = repr(exc)
    else:
        return wire.StepDone(output, records.take(), _bound(worker))
    if report is None:  # cut at the deadline: the step log still has its report
        report = next(
            (r.report for r in reversed(records.items) if r.report.step_id == step_id), None
        )
    fatal = _sharded(worker) and breaks_group(report, collective_stages(worker.graph))
    if fatal:
        _log.error("tensor_parallel_step_broken", step_id=step_id, reason=reason)
    return wire.StepFailed(
        worker.rank, step_id, reason, report, records.take(), _bound(worker), fatal=fatal
    )


def _sharded(worker: Worker) -> bool:
    tp = getattr(worker.runner, "tp", None)
    return bool(tp is not None and tp.sharded)


def collective_stages(graph: StepGraph) -> frozenset[str]:
    """The names of ``graph``'s stages that declare collectives (``collective = True``)."""
    return frozenset(s.name for s in graph.stages if is_collective(s))


def breaks_group(report: StepReport | None, collective: Iterable[str]) -> bool:
    """Whether a failed step leaves a tensor-parallel rank out of step with its group.

    ``True`` unless every stage named in ``collective`` completed (``ok``) in
    ``report``; also ``True`` without a report (the step's state is unknown).
    """
    if report is None:
        return True
    completed = {r.name for r in report.stages if r.outcome == "ok"}
    return not completed.issuperset(collective)


def _bound(worker: Worker) -> bool:
    return worker.connector is not None and worker.connector.connector_metadata is not None


def bind_worker_context(rank: int) -> None:
    """Bind ``rank`` and ``pid`` into structlog's contextvars for every event of this process.

    Every kvstep event of the worker then carries them (:mod:`pipeline.logger` merges
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

    from stages.model.shm_allreduce import SharedMemoryAllReduce

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

    from stages.model.parallel import init_process_group
    from stages.model.runner import ModelRunner
    from stages.model.settings import RunnerSettings

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
    settings = RunnerSettings.from_config(config, device=init.device)
    runner = ModelRunner.load(settings, rank=init.rank, tp=tp)
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
    (:func:`pipeline.executors.remote_worker.answer`); the worker keeps serving.
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
    parser = argparse.ArgumentParser(prog="python -m pipeline.executors.remote_worker")
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
    channel.send_sync(
        wire.Ready(
            init.rank,
            os.getpid(),
            worker.runner.num_blocks,
            fingerprint,
            worker.runner.linear_kernel,
            worker.runner.compiled,
        )
    )
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
        from stages.model.parallel import destroy_process_group

        destroy_process_group()
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
