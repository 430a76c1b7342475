"""The messages between the engine and its worker processes, as msgspec structs.

Every message is one of :data:`Message`'s tagged structs, encoded with msgpack; the
decoder accepts nothing else, and the encoder has no fallback for other Python objects,
so nothing is ever pickled. Artifacts (``SchedulerOutput``, ``WorkerOutput``,
``StepReport``) are attrs classes of plain values, which msgspec encodes natively.
Connector metadata travels as its own ``to_bytes()`` plus the path of its class, which
the worker resolves only against an allow-list
(:func:`pipeline.executors.wire_checks.metadata_types`: the metadata classes of its
registered connector); nothing named in a frame is imported.

Conversation: engine → ``Init``; worker → ``Ready`` (or ``InitFailed``); then per step
engine → ``Step``, worker → ``StepDone`` or ``StepFailed``; finally engine → ``Shutdown``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import msgspec

from connectors.base import KVConnectorMetadata, ModelFingerprint
from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.errors import TransportError, short_repr
from pipeline.kernel.report import StepReport

__all__ = [
    "Init",
    "InitFailed",
    "Message",
    "Ready",
    "Shutdown",
    "Step",
    "StepDone",
    "StepFailed",
    "WorkerRecord",
    "decode",
    "decode_metadata",
    "encode",
    "encode_step",
    "recover_step_id",
]


class Init(msgspec.Struct, frozen=True, tag="init"):
    """Engine → worker, once: who the worker is and what it loads.

    Attributes:
        rank: The worker's rank (its tensor-parallel rank).
        world_size: Number of ranks.
        config: The ``EngineConfig`` as plain values.
        device: This rank's device (``cpu``, ``cuda:N``).
        dist_backend: ``gloo`` or ``nccl``.
        dist_init_method: Where the ranks meet (``file://...`` or ``tcp://host:port``).
        connector_classes: Import paths of the connector's scheduler and worker classes
            (so a connector registered in the engine's process exists here), or ``None``.
        worker_graph: Import path of a function from the default worker graph to a new
            one, or ``None``.
        shm_allreduce: A new file the ranks map to sum activations through shared memory
            (CPU ranks on one host), or ``None`` to reduce with ``dist_backend`` only.
        shm_slot_bytes: The size of each rank's slot in that file (the engine decided it,
            and that the file fits, once for every rank).
    """

    rank: int
    world_size: int
    config: dict[str, Any]
    device: str
    dist_backend: str
    dist_init_method: str
    connector_classes: tuple[str, str] | None = None
    worker_graph: str | None = None
    shm_allreduce: str | None = None
    shm_slot_bytes: int = 0


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Worker → engine: the model is loaded and the step loop is running."""

    rank: int
    pid: int
    num_blocks: int
    fingerprint: ModelFingerprint
    linear_kernel: str = "mkl"  # what the rank's projections run on (linear_kernels)
    compiled: bool = False  # whether its passes run compiled (compiled_forward)


class InitFailed(msgspec.Struct, frozen=True, tag="init_failed"):
    """Worker → engine: starting failed; the worker exits after sending it."""

    rank: int
    error_type: str
    message: str


class Step(msgspec.Struct, frozen=True, tag="step"):
    """Engine → worker: run one step. ``scheduler_output`` carries no metadata object."""

    scheduler_output: SchedulerOutput
    metadata_type: str | None = None
    metadata: bytes | None = None


class WorkerRecord(msgspec.Struct, frozen=True):
    """One step record of the worker's graph, written to the engine's step log."""

    report: StepReport
    fields: dict[str, Any]


class StepDone(msgspec.Struct, frozen=True, tag="step_done"):
    """Worker → engine: the step's output, its step records, and whether metadata is
    still bound after the step (a leak: it must be ``False``)."""

    output: WorkerOutput
    records: list[WorkerRecord]
    metadata_bound: bool = False


class StepFailed(msgspec.Struct, frozen=True, tag="step_failed"):
    """Worker → engine: the step failed on this rank (its finalizers ran).

    ``fatal``: the rank cannot run another step (its tensor-parallel group may be out of
    step: the forward pass, where the collectives are, did not complete); the worker
    exits after sending it.
    """

    rank: int
    step_id: int
    reason: str
    report: StepReport | None
    records: list[WorkerRecord]
    metadata_bound: bool = False
    fatal: bool = False


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Engine → worker: close the worker and exit."""


Message = Init | Ready | InitFailed | Step | StepDone | StepFailed | Shutdown
_TYPES = (Init, Ready, InitFailed, Step, StepDone, StepFailed, Shutdown)

_encoder = msgspec.msgpack.Encoder()  # no enc_hook: anything else is refused
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """msgpack bytes of one message.

    Raises:
        TransportError: ``message`` is not a wire message, or holds a value msgspec
            cannot encode natively (there is no pickle fallback).
    """
    if not isinstance(message, _TYPES):
        raise TransportError(
            f"refusing to send a {type(message).__qualname__}: only the wire messages "
            f"({', '.join(t.__name__ for t in _TYPES)}) cross the process boundary"
        )
    try:
        return _encoder.encode(message)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TransportError(
            f"refusing to send {type(message).__name__}: a value is not msgspec-encodable "
            f"({exc}); kvstep never pickles"
        ) from exc


def decode(data: bytes | memoryview) -> Message:
    """The message in ``data``.

    Raises:
        TransportError: The bytes are not one of the wire messages.
    """
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise TransportError(f"undecodable message ({len(data)} bytes): {exc}") from exc


class _StepId(msgspec.Struct):
    step_id: int


class _StepHeader(msgspec.Struct, tag="step"):
    scheduler_output: _StepId


_header_decoder = msgspec.msgpack.Decoder(_StepHeader)


def recover_step_id(data: bytes | memoryview) -> int | None:
    """The step id of a ``Step`` frame that :func:`decode` refused, or ``None``.

    Reads only ``scheduler_output.step_id`` (every other field is ignored), so a frame
    whose requests hold a value the typed decoder rejects still names its step: the
    worker answers ``StepFailed`` for that step instead of dying. ``None``: the bytes
    are not a ``Step`` at all.
    """
    try:
        return _header_decoder.decode(data).scheduler_output.step_id
    except msgspec.DecodeError:
        return None


def encode_step(scheduler_output: SchedulerOutput) -> bytes:
    """The ``Step`` message of ``scheduler_output``, its metadata as bytes + class path."""
    metadata = scheduler_output.kv_connector_metadata
    if metadata is None:
        return encode(Step(scheduler_output))
    if not isinstance(metadata, KVConnectorMetadata):
        raise TransportError(
            f"connector metadata of type {type(metadata).__qualname__} cannot cross a process "
            "boundary: it must subclass KVConnectorMetadata (to_bytes/from_bytes)"
        )
    cls = type(metadata)
    return encode(
        Step(
            attrs.evolve(scheduler_output, kv_connector_metadata=None),
            metadata_type=f"{cls.__module__}:{cls.__qualname__}",
            metadata=metadata.to_bytes(),
        )
    )


def decode_metadata(
    step: Step, allowed: Mapping[str, type[KVConnectorMetadata]] | None = None
) -> SchedulerOutput:
    """``step``'s SchedulerOutput with its connector metadata object rebuilt.

    Args:
        step: The decoded step.
        allowed: ``"module:qualname"`` → metadata class (the worker's connector's
            :func:`pipeline.executors.wire_checks.metadata_types`). The class named by the frame
            is looked up here and nowhere else: no module named in a frame is imported.

    Raises:
        TransportError: The metadata class is not in ``allowed``, or rejects the bytes.
    """
    if step.metadata_type is None or step.metadata is None:
        return step.scheduler_output
    cls = (allowed or {}).get(step.metadata_type)
    if cls is None:
        raise TransportError(
            f"connector metadata class {short_repr(step.metadata_type)} is not the metadata "
            f"of the registered connector (allowed: {', '.join(sorted(allowed or {})) or 'none'})"
        )
    try:
        metadata = cls.from_bytes(step.metadata)
    except Exception as exc:
        raise TransportError(f"{step.metadata_type} rejected its bytes: {exc!r}") from exc
    return attrs.evolve(step.scheduler_output, kv_connector_metadata=metadata)
