"""Every exception kvstep raises on purpose, in one place.

Each class subclasses the builtin a caller would naturally catch (``ValueError`` for bad
input, ``RuntimeError`` for a state the engine is in, ...), and each message names the
offending value and what would have been accepted.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = [
    "MAX_VALUE_REPR",
    "ConnectorLifecycleError",
    "DuplicateConnectorError",
    "EngineDeadError",
    "EngineNotStartedError",
    "EngineOverloaded",
    "FaultInjected",
    "FinalizerError",
    "FrameError",
    "GraphError",
    "InvalidConfigError",
    "InvalidRequestError",
    "KvstepError",
    "ModelLoadError",
    "StageError",
    "StepCancelledError",
    "StepFailedError",
    "StepFailure",
    "TransportError",
    "UnknownConnectorError",
    "WorkerDiedError",
    "WorkerFailedError",
    "short_repr",
]


#: Longest repr of an offending value that an error message embeds.
MAX_VALUE_REPR = 80

_repr = reprlib.Repr()
_repr.maxlevel = 2
_repr.maxlist = _repr.maxtuple = _repr.maxset = _repr.maxfrozenset = _repr.maxdict = 6
_repr.maxstring = _repr.maxother = MAX_VALUE_REPR


def short_repr(value: object, limit: int = MAX_VALUE_REPR) -> str:
    """A repr of ``value`` of at most ``limit`` characters, cheap whatever its size.

    An error message names the offending value, but a hostile one (``10**400``, a list of
    a million ids) must not land in a message, a log line or an HTTP body whole: a big
    integer is described by its size, containers show their first few items, and the
    result is cut to ``limit`` characters. Never raises.
    """
    try:
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
            text = f"<int of {value.bit_length()} bits>"
        else:
            text = _repr.repr(value)
    except Exception:  # a hostile __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class KvstepError(Exception):
    """Base class of every error raised by kvstep on purpose."""


class InvalidConfigError(KvstepError, ValueError):
    """A configuration field has a value outside what it allows."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={short_repr(value)}: {allowed}")


class InvalidRequestError(KvstepError, ValueError):
    """A request (prompt or sampling parameters) cannot be served; it fails alone."""

    def __init__(self, what: str, value: object, allowed: str) -> None:
        self.what = what
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {what}={short_repr(value)}: {allowed}")


class UnknownConnectorError(KvstepError, KeyError):
    """A connector name that is not registered."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown connector {self.name!r}; registered: {', '.join(self.known) or 'none'}"


class DuplicateConnectorError(KvstepError, ValueError):
    """A connector name that is already registered (pass ``replace=True`` to override)."""

    def __init__(self, name: str, existing: object) -> None:
        self.name = name
        self.existing = existing
        super().__init__(
            f"connector {name!r} is already registered ({existing!r}); "
            "choose another name or pass replace=True"
        )


class ModelLoadError(KvstepError, ValueError):
    """A model directory or checkpoint that cannot be loaded."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot load model from {str(path)!r}: {reason}")


class FrameError(KvstepError, ValueError):
    """A stored KV value (``connectors.framing``) does not match what the reader expects.

    Raised on truncation, a wrong magic/version, another key, layer count, dtype or
    shape, or a checksum mismatch; a connector turns it into a load error, never data.

    Attributes:
        what: What mismatched (``"magic"``, ``"key"``, ``"checksum"``, ...).
        expected: What the reader expected.
        got: What the value holds.
    """

    def __init__(self, what: str, expected: object, got: object) -> None:
        self.what = what
        self.expected = expected
        self.got = got
        super().__init__(f"bad KV frame: {what} is {got!r}, expected {expected!r}")


class GraphError(KvstepError, ValueError):
    """A step graph that cannot be built: names the stage and the artifact type."""

    def __init__(self, message: str, *, stage: str | None = None, artifact: str | None = None):
        self.stage = stage
        self.artifact = artifact
        super().__init__(message)


class ConnectorLifecycleError(KvstepError, RuntimeError):
    """A KV connector call out of its per-step order."""

    def __init__(self, step_id: int | None, call: str, previous: str, allowed: Iterable[str]):
        self.step_id = step_id
        self.call = call
        self.previous = previous
        self.allowed = tuple(allowed)
        super().__init__(
            f"step {step_id}: connector call {call!r} after {previous!r}; "
            f"{call!r} may only follow {' | '.join(repr(a) for a in self.allowed)}"
        )


class StageError(KvstepError, RuntimeError):
    """A stage failed; wraps nothing, carries the stage name and step id for logs."""

    def __init__(self, stage: str, step_id: int, reason: str) -> None:
        self.stage = stage
        self.step_id = step_id
        super().__init__(f"step {step_id}: stage {stage!r} failed: {reason}")


class FinalizerError(KvstepError, RuntimeError):
    """One or more finalizers failed on a step whose body succeeded."""

    def __init__(self, step_id: int, failures: dict[str, BaseException]) -> None:
        self.step_id = step_id
        self.failures = dict(failures)
        detail = "; ".join(f"{name}: {exc!r}" for name, exc in self.failures.items())
        super().__init__(f"step {step_id}: finalizer(s) failed: {detail}")


class FaultInjected(KvstepError, RuntimeError):
    """A fault injected on purpose by the fault-injection tools (tests, chaos runs).

    Raised by ``connectors.testing.FaultyConnector`` at a connector call and by
    ``connectors.testing.FaultStage`` in a step graph; never by the engine itself.

    Attributes:
        call: The connector method, or ``"stage <name>"`` for a fault stage.
        step: The step it fired in (``None`` outside a step).
        rank: The rank it fired on (``None`` on the engine side of a stage fault).
        action: The fault's action (``"raise"``, or the action that could not run).
    """

    def __init__(
        self, call: str, step: int | None, rank: int | None, action: str = "raise"
    ) -> None:
        self.call = call
        self.step = step
        self.rank = rank
        self.action = action
        super().__init__(f"injected fault ({action}) at {call} in step {step} on rank {rank}")


class EngineOverloaded(KvstepError, RuntimeError):
    """Admission refused: the engine already holds its configured number of requests."""

    def __init__(self, depth: int, limit: int) -> None:
        self.depth = depth
        self.limit = limit
        super().__init__(f"engine overloaded: {depth} requests in flight, limit {limit}")


class EngineDeadError(KvstepError, RuntimeError):
    """The engine's step loop has died; every caller gets this, with the cause chained."""


class EngineNotStartedError(KvstepError, RuntimeError):
    """The engine is not running: used before ``async with AsyncEngine(...)``, or after it closed.

    Distinct from :class:`EngineDeadError` (nothing failed); a server answers it with 503 too.
    """


class WorkerFailedError(KvstepError, RuntimeError):
    """A worker rank raised or missed the fan-in deadline; names the rank.

    ``report`` is that rank's step report when it has one (which stage failed, which
    finalizers failed); ``None`` when the rank gave no answer at all.
    """

    def __init__(self, rank: int, step_id: int, reason: str, report: Any = None) -> None:
        self.rank = rank
        self.step_id = step_id
        self.reason = reason
        self.report = report
        super().__init__(f"step {step_id}: worker rank {rank} failed: {reason}")


class WorkerDiedError(WorkerFailedError):
    """A worker process (or Ray actor) is gone: the executor cannot run another step.

    The step in flight fails with it; the engine then raises :class:`EngineDeadError` to
    every caller. ``exit_code`` is the process's exit status when known (negative: the
    signal that killed it).
    """

    def __init__(self, rank: int, step_id: int, reason: str, exit_code: int | None = None) -> None:
        self.exit_code = exit_code
        super().__init__(rank, step_id, reason)


class TransportError(KvstepError, RuntimeError):
    """A message between the engine and a worker process could not be sent or read.

    Raised for a payload that is not one of the wire message types (nothing is ever
    pickled), bytes that do not decode as one, an oversized frame, or a closed peer.
    """


@attrs.frozen(kw_only=True)
class StepFailure:
    """Why a step failed, as data: delivered to every request of that step.

    Attributes:
        step_id: The step.
        failed_stages: The stages that raised, ``"stage"`` on the engine and
            ``"rank<r>:stage"`` on a worker.
        failed_finalizers: Finalizers that failed (their failure never hides the
            original error), in the same naming.
        ranks: The worker ranks that failed or gave no answer.
        cancelled: Whether the step (or a rank's part of it) was cancelled, e.g. at the
            fan-in deadline.
        message: The original error, as text.
    """

    step_id: int
    failed_stages: tuple[str, ...] = ()
    failed_finalizers: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    cancelled: bool = False
    message: str = ""

    def __str__(self) -> str:
        parts = [f"step {self.step_id} failed"]
        if self.failed_stages:
            parts.append(f"in {', '.join(self.failed_stages)}")
        if self.failed_finalizers:
            parts.append(f"(finalizers failed: {', '.join(self.failed_finalizers)})")
        if self.cancelled:
            parts.append("(cancelled)")
        return " ".join(parts) + (f": {self.message}" if self.message else "")


class StepFailedError(KvstepError, RuntimeError):
    """A request ended because the step it was in failed; carries the :class:`StepFailure`."""

    def __init__(self, failure: StepFailure) -> None:
        self.failure = failure
        super().__init__(str(failure))


class StepCancelledError(KvstepError, RuntimeError):
    """A step was cancelled by a native ``task.cancel()`` that no cancel scope asked for.

    The engine fails that step's requests (``StepFailure.cancelled``) and keeps serving.
    """

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        super().__init__(f"step {step_id}: a stage's task was cancelled (task.cancel())")
