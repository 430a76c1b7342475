"""The per-step context: the artifacts one step has produced so far, keyed by type.

A :class:`StepContext` is created by the engine (or a worker) for one step on one rank,
seeded with the graph's inputs, and handed to every stage of that step. Stages read what
they declared in ``requires`` with :meth:`StepContext.get`; the runner stores what each
stage returns under its ``provides`` type. Finalizers, which declare nothing, read with
:meth:`StepContext.maybe` because the body may have failed before producing anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.errors import GraphError

if TYPE_CHECKING:
    from pipeline.kernel.report import StepReport

__all__ = ["StepContext"]

T = TypeVar("T")


def _type_name(artifact_type: type) -> str:
    return getattr(artifact_type, "__qualname__", repr(artifact_type))


class StepContext:
    """Per-step, per-rank state: the artifacts produced so far.

    One context lives for exactly one step on one rank and is never reused. It is not
    thread-safe: it belongs to the event loop that runs the step (a stage that hands
    work to a thread passes it the values, not the context).

    Attributes:
        step_id: The step number (the engine's monotonic counter).
        rank: The worker rank, or ``None`` on the engine (scheduler) side.
        error: Set by the runner before the finalizers run: the body's exception (or
            the cancellation), ``None`` when the body succeeded.
        cancelled: Set by the runner before the finalizers run: the body was cancelled.
        scratch: A stage's own per-step state (e.g. a finalizer's "already ran" flag),
            under keys prefixed with its name. Never a channel between stages: what one
            stage hands another is a typed artifact, so the printed graph shows it.
        report: The :class:`~pipeline.kernel.report.StepReport` of the step, filled by the
            runner when the step ends, also when the run raises. While the finalizers of
            a step whose body failed run, it holds the body's report (no finalizer
            records yet), so a finalizer can tell which stage failed.
    """

    __slots__ = ("_artifacts", "cancelled", "error", "rank", "report", "scratch", "step_id")

    def __init__(
        self, step_id: int, rank: int | None = None, inputs: Iterable[object] = ()
    ) -> None:
        """Create the context of one step.

        Args:
            step_id: The step number.
            rank: The worker rank, ``None`` on the engine side.
            inputs: The graph's input artifacts, each stored under its exact type
                (``type(value)``, not a base class).

        Raises:
            GraphError: Two inputs of the same type.
        """
        self.step_id = step_id
        self.rank = rank
        self._artifacts: dict[type, object] = {}
        self.error: BaseException | None = None
        self.cancelled = False
        self.scratch: dict[str, Any] = {}
        self.report: StepReport | None = None
        for value in inputs:
            artifact_type = type(value)
            if artifact_type in self._artifacts:
                raise GraphError(
                    f"step {step_id}: two inputs of type {_type_name(artifact_type)}; "
                    "a context holds one artifact per type",
                    artifact=_type_name(artifact_type),
                )
            self._artifacts[artifact_type] = value

    def get(self, artifact_type: type[T]) -> T:
        """Return the artifact of ``artifact_type``; for types a stage declared in ``requires``.

        Non-blocking, O(1).

        Raises:
            GraphError: No artifact of that type in this step (naming the type and the
                types present).
        """
        try:
            return self._artifacts[artifact_type]  # type: ignore[return-value]
        except KeyError:
            present = ", ".join(sorted(_type_name(t) for t in self._artifacts)) or "none"
            raise GraphError(
                f"step {self.step_id}: no artifact of type {_type_name(artifact_type)} "
                f"in the context; present: {present}",
                artifact=_type_name(artifact_type),
            ) from None

    def maybe(self, artifact_type: type[T]) -> T | None:
        """Return the artifact of ``artifact_type``, or ``None`` if the step has none.

        This is how finalizers read: the body may have failed before producing it.
        """
        return self._artifacts.get(artifact_type)  # type: ignore[return-value]

    def put(self, value: object, artifact_type: type | None = None) -> None:
        """Store ``value`` under ``artifact_type`` (default: its exact type), replacing any.

        The runner calls this for every stage's result; stages rarely need to.

        Raises:
            GraphError: ``value`` is not an instance of ``artifact_type``.
        """
        if artifact_type is None:
            artifact_type = type(value)
        elif not isinstance(value, artifact_type):
            raise GraphError(
                f"step {self.step_id}: cannot store {type(value).__qualname__} value "
                f"as {_type_name(artifact_type)}; it must be an instance of that type",
                artifact=_type_name(artifact_type),
            )
        self._artifacts[artifact_type] = value

    def __contains__(self, artifact_type: object) -> bool:
        """Whether the step holds an artifact of exactly this type."""
        return artifact_type in self._artifacts

    @property
    def artifact_types(self) -> tuple[type, ...]:
        """The types of the artifacts present, in insertion order."""
        return tuple(self._artifacts)

    def __repr__(self) -> str:
        types = ", ".join(_type_name(t) for t in self._artifacts)
        return f"StepContext(step_id={self.step_id}, rank={self.rank}, artifacts=[{types}])"
