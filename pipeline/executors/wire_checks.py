"""What the engine↔worker wire refuses, decided without trusting a frame.

* :func:`metadata_types`: the allow-list of connector metadata classes a worker
  rebuilds (:func:`pipeline.executors.wire.decode_metadata` looks a frame's class up there and
  imports nothing);
* :func:`encode_step_isolated`: encode a step, and when that fails, leave out only the
  requests that cannot be encoded (each fails alone) instead of failing the batch.
"""

from __future__ import annotations

import sys

import attrs
import msgspec

from connectors.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker
from pipeline.artifacts import SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError, TransportError, short_repr
from pipeline.executors import wire

__all__ = [
    "EncodedStep",
    "check_sendable",
    "encode_step_isolated",
    "metadata_types",
    "unencodable_requests",
]

_encoder = msgspec.msgpack.Encoder()  # no enc_hook, like the wire's
_params_decoder = msgspec.msgpack.Decoder(SamplingParams)


def check_sendable(params: object) -> SamplingParams:
    """``params`` if a worker's typed decoder accepts it as sent; the engine's admission.

    ``SamplingParams`` checks its fields at construction; this also refuses an object
    that is not one, or one altered after construction, so that whatever the engine
    admits crosses the wire (microseconds: a few fields are encoded and decoded).

    Raises:
        InvalidRequestError: Not a ``SamplingParams``, or one the wire refuses; names
            the field when msgspec does.
    """
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            "sampling params", type(params).__name__, "must be a SamplingParams"
        )
    try:
        _params_decoder.decode(_encoder.encode(params))
    except (msgspec.DecodeError, TypeError, ValueError, OverflowError) as exc:
        reason = str(exc)[:200]
        raise InvalidRequestError(
            "sampling params", params, f"the workers' decoder refuses it: {reason}"
        ) from exc
    return params


@attrs.frozen
class EncodedStep:
    """A step's frame, and the requests left out of it (request id → why)."""

    frame: bytes
    request_errors: dict[str, str] = attrs.field(factory=dict)


def encode_step_isolated(scheduler_output: SchedulerOutput) -> EncodedStep:
    """:func:`pipeline.executors.wire.encode_step`, failing only the requests at fault.

    Admission (``SamplingParams``' checks) makes a request that cannot be encoded
    unreachable; should one still get through, the step is sent without it and it is
    named in ``request_errors`` (the engine ends it with ``"error"``), so the other
    requests of the step run.

    Raises:
        TransportError: The step cannot be encoded for another reason (the connector
            metadata, or no single request is at fault): the whole step fails.
    """
    try:
        return EncodedStep(wire.encode_step(scheduler_output))
    except TransportError:
        bad = unencodable_requests(scheduler_output)
        if not bad:
            raise
    kept = tuple(r for r in scheduler_output.requests if r.req_id not in bad)
    frame = wire.encode_step(attrs.evolve(scheduler_output, requests=kept))
    return EncodedStep(frame, bad)


def unencodable_requests(scheduler_output: SchedulerOutput) -> dict[str, str]:
    """The scheduled requests that cannot be encoded on their own, with why.

    Called when :func:`encode_step` failed, to fail only the requests at fault (the
    executor sends the step without them). Empty: the fault is elsewhere (e.g. the
    connector metadata), and the whole step fails.
    """
    bad: dict[str, str] = {}
    for request in scheduler_output.requests:
        try:
            _encoder.encode(request)
        except (TypeError, ValueError, OverflowError) as exc:
            bad[request.req_id] = f"request cannot be sent to the workers: {short_repr(exc, 200)}"
    return bad


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        found.append(sub)
        todo.extend(sub.__subclasses__())
    return found


def metadata_types(
    scheduler_cls: type[KVConnectorScheduler] | None, worker_cls: type[KVConnectorWorker] | None
) -> dict[str, type[KVConnectorMetadata]]:
    """The allow-list of :func:`decode_metadata` for one registered connector.

    A connector's metadata class is one it names in a ``metadata_cls`` class attribute
    (either half), or an already imported ``KVConnectorMetadata`` subclass defined in
    the package of one of its halves' classes (their MROs, below the base classes):
    registering a connector imports its halves, and so the module of its metadata.
    Nothing is imported here. Without a connector the list is empty.

    Returns:
        ``"module:qualname"`` → class.
    """
    halves = [c for c in (scheduler_cls, worker_cls) if c is not None]
    declared = [getattr(c, "metadata_cls", None) for c in halves]
    allowed: dict[str, type[KVConnectorMetadata]] = {
        _path(c): c for c in declared if isinstance(c, type) and issubclass(c, KVConnectorMetadata)
    }
    bases = (KVConnectorScheduler, KVConnectorWorker)
    modules = {k.__module__ for half in halves for k in half.__mro__ if issubclass(k, bases)}
    modules -= {b.__module__ for b in bases}
    packages = {m.rpartition(".")[0] or m for m in modules}
    for cls in _subclasses(KVConnectorMetadata):
        module = cls.__module__
        if not _canonical(cls):
            continue
        if module in modules or any(module == p or module.startswith(p + ".") for p in packages):
            allowed[_path(cls)] = cls
    return allowed


def _canonical(cls: type) -> bool:
    """Whether ``cls`` is what its module names: ``attrs`` (slotted classes) and other
    class decorators build a new class, and the one they replaced lingers among the
    base's ``__subclasses__()`` until it is collected; it must never win the path."""
    owner: object = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        owner = getattr(owner, part, None)
    return owner is cls
