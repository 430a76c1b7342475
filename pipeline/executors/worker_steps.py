"""How a worker outside the engine's process answers one step frame.

Shared by the ``multiproc`` worker process (:mod:`pipeline.executors.worker_proc`) and the Ray
actor (:mod:`pipeline.executors.ray_actor`). Every frame gets exactly one reply and no frame
kills the worker:

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

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import anyio

from connectors.base import KVConnectorMetadata
from pipeline.errors import TransportError, WorkerFailedError, short_repr
from pipeline.executors import wire
from pipeline.executors.wire_checks import metadata_types
from pipeline.executors.worker import Worker
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StepReport
from pipeline.kernel.stage import is_collective
from pipeline.logs import get_logger

__all__ = [
    "Answer",
    "MetadataTypes",
    "Records",
    "answer",
    "breaks_group",
    "collective_stages",
    "connector_metadata_types",
    "encode_reply",
    "run_step",
]

_log = get_logger()
_REASON_CHARS = 500

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
