"""The stage protocol, the finalizer protocol, and function stages.

A **stage** is a small object with a ``name``, the artifact types it ``requires``, the one
artifact type it ``provides`` (or ``None``), and one ``async`` method ``run(ctx)`` that
returns that artifact. Class stages are usually frozen attrs classes whose name and types
are ``ClassVar``; a plain async function with annotations becomes a stage through
:func:`stage`::

    @stage
    async def sample(ctx: StepContext, out: ModelOutput) -> SampledTokens: ...

A **finalizer** is a stage that runs after the body of every step, whatever happened.
Its ``run`` is the awaited part (draining), bounded by ``timeout_s`` and shielded from
cancellation; its ``finalize`` is the synchronous critical part, run in the innermost
``finally``. Subclass :class:`Finalizer` to get the defaults.
"""

from __future__ import annotations

import abc
import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol, overload, runtime_checkable

import attrs

from pipeline.errors import GraphError
from pipeline.kernel.context import StepContext

__all__ = [
    "Finalizer",
    "FunctionStage",
    "Stage",
    "as_stage",
    "is_collective",
    "is_finalizer",
    "is_immediate",
    "lane",
    "stage",
]

DEFAULT_FINALIZER_TIMEOUT_S = 5.0
"""Default bound, in seconds, on a finalizer's awaited drain."""


@runtime_checkable
class Stage(Protocol):
    """One step of a step graph.

    Attributes (class or instance attributes; read once, when the graph is built):
        name: Unique within a graph.
        requires: The artifact types ``run`` reads with ``ctx.get(T)``; the graph runs
            the stage once all of them exist.
        provides: The artifact type ``run`` returns, stored in the context under that
            type; ``None``: ``run`` returns ``None`` (any other value is ignored).

    Optional attribute (absent means ``False``; read with :func:`is_collective`):
        collective: ``run`` takes part in collectives across the ranks of a
            tensor-parallel group (an all-reduce in the forward pass). A worker whose step
            failed before every collective stage completed is out of step with its group,
            so the failure is fatal to that worker; any other failure fails the step only.

    Optional attribute (absent means ``False``; read with :func:`is_immediate`):
        immediate: ``run`` returns without waiting on anything (it never suspends), as a
            stage decides when it is built (``save`` without a connector). In a parallel
            block the runner then runs it in the current task before the other
            branches, and a block left with one branch that waits needs no task group.
            A stage that does suspend anyway only loses its concurrency, never a result.

    Optional attributes of a **compute stage** (read with :func:`lane`; see
    :class:`~pipeline.kernel.compute.ComputeStage`):
        runs_on: The name of the thread its work runs on (``"compute"``: a model
            runner's). Its synchronous ``compute(ctx)`` returns the artifact, and
            ``run`` awaits it. The plan fuses adjacent stages of one ``runs_on`` (a
            series, or a series and the head of a parallel branch) into one call of
            their ``compute`` methods in a row, handed over once: the first member's
            ``hop(ctx, work)`` that has one (``async``; it runs ``work()`` on the
            thread and returns its result), or on the event loop when none has one.
    """

    @property
    def name(self) -> str: ...

    @property
    def requires(self) -> tuple[type, ...]: ...

    @property
    def provides(self) -> type | None: ...

    async def run(self, ctx: StepContext) -> Any:
        """Do this stage's work for one step and return its artifact.

        Called once per step, on the event loop, when every required artifact exists;
        may run concurrently with other stages of the same step. Must not block the
        loop (hand blocking work to a thread). Must be cancellation-safe: when a sibling
        stage fails or the step is cancelled, it is cancelled at any ``await``.
        """
        ...


@runtime_checkable
class Finalizer(Protocol):
    """A stage that runs after the body of every step: success, error, cancellation, timeout.

    Subclass it to inherit the defaults (``requires=()``, ``provides=None``,
    ``mandatory=False``, ``timeout_s=5.0``, a no-op ``run``) and implement
    :meth:`finalize`. Finalizers run in reverse declaration order, each isolated from
    the others' failures. They declare no artifacts; they read with ``ctx.maybe(T)``,
    and ``ctx.error`` / ``ctx.cancelled`` tell them how the body ended.

    Attributes:
        finalizer: Always ``True``; marks the stage as a finalizer.
        name: Unique within a graph.
        mandatory: The graph refuses ``without()`` and ``replace()`` of it.
        timeout_s: Bound, in seconds, on the awaited ``run``; the drain is cut after it.
    """

    finalizer: ClassVar[bool] = True

    @property
    def name(self) -> str: ...

    @property
    def requires(self) -> tuple[type, ...]:
        return ()

    @property
    def provides(self) -> type | None:
        return None

    @property
    def mandatory(self) -> bool:
        return False

    @property
    def timeout_s(self) -> float:
        return DEFAULT_FINALIZER_TIMEOUT_S

    async def run(self, ctx: StepContext) -> None:
        """Awaited cleanup (e.g. drain pending saves); the default does nothing.

        Runs under ``anyio.move_on_after(timeout_s, shield=True)``: an enclosing
        cancellation does not interrupt it, the timeout does. A native second
        ``task.cancel()`` can still interrupt it; :meth:`finalize` runs anyway.
        """
        return None

    @abc.abstractmethod
    def finalize(self, ctx: StepContext) -> None:
        """Synchronous critical cleanup (e.g. clear connector metadata).

        Runs in the innermost ``finally`` after :meth:`run`, even when ``run`` raised or
        was cut. Must not block for long, must be idempotent (running twice is a no-op),
        and must not await anything.
        """


def is_finalizer(obj: object) -> bool:
    """Whether ``obj`` is marked as a finalizer (``finalizer`` attribute is ``True``)."""
    return getattr(obj, "finalizer", False) is True


def is_collective(obj: object) -> bool:
    """Whether stage ``obj`` declares collectives (``collective`` attribute is ``True``)."""
    return getattr(obj, "collective", False) is True


def is_immediate(obj: object) -> bool:
    """Whether stage ``obj`` never suspends (``immediate`` attribute is ``True``)."""
    return getattr(obj, "immediate", False) is True


def lane(obj: object) -> str | None:
    """The thread a compute stage runs on (its ``runs_on``), or ``None`` for a stage
    that runs on the event loop."""
    value = getattr(obj, "runs_on", None)
    return value if isinstance(value, str) else None


@attrs.frozen
class FunctionStage:
    """A stage made from an annotated async function; build it with :func:`stage`.

    ``run(ctx)`` calls ``fn(ctx, ctx.get(A), ctx.get(B), ...)`` for ``requires=(A, B,
    ...)``. Calling the object calls the function unchanged, so a decorated function
    stays usable directly (e.g. in tests).
    """

    name: str
    requires: tuple[type, ...]
    provides: type | None
    fn: Callable[..., Awaitable[Any]] = attrs.field(repr=False)

    async def run(self, ctx: StepContext) -> Any:
        """Call the function with the context and its required artifacts."""
        return await self.fn(ctx, *map(ctx.get, self.requires))

    def __call__(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self.fn(*args, **kwargs)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _function_stage(fn: Callable[..., Awaitable[Any]], name: str | None) -> FunctionStage:
    label = getattr(fn, "__qualname__", repr(fn))
    if not inspect.iscoroutinefunction(fn):
        raise GraphError(
            f"cannot make a stage of {label!r}: it must be an `async def` function", stage=label
        )
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise GraphError(
            f"cannot make a stage of {label!r}: its annotations do not resolve ({exc})",
            stage=label,
        ) from exc
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in _POSITIONAL:
        raise GraphError(
            f"cannot make a stage of {label!r}: its first parameter must be the step "
            "context, `ctx: StepContext`",
            stage=label,
        )
    ctx_hint = hints.get(params[0].name)
    if not (isinstance(ctx_hint, type) and issubclass(ctx_hint, StepContext)):
        raise GraphError(
            f"cannot make a stage of {label!r}: its first parameter {params[0].name!r} must "
            f"be annotated as StepContext, not {ctx_hint!r}",
            stage=label,
        )
    requires: list[type] = []
    for param in params[1:]:
        hint = hints.get(param.name)
        if param.kind not in _POSITIONAL or not isinstance(hint, type):
            raise GraphError(
                f"cannot make a stage of {label!r}: parameter {param.name!r} must be a "
                f"positional parameter annotated with an artifact class, not {hint!r}",
                stage=label,
                artifact=None if hint is None else str(hint),
            )
        requires.append(hint)
    if "return" not in hints:
        raise GraphError(
            f"cannot make a stage of {label!r}: its return must be annotated with the "
            "artifact class it provides, or `-> None`",
            stage=label,
        )
    ret = hints["return"]
    if ret is type(None):
        provides: type | None = None
    elif isinstance(ret, type):
        provides = ret
    else:
        raise GraphError(
            f"cannot make a stage of {label!r}: return annotation {ret!r} is not an "
            "artifact class (or None)",
            stage=label,
            artifact=str(ret),
        )
    return FunctionStage(
        name=name if name is not None else fn.__name__,
        requires=tuple(requires),
        provides=provides,
        fn=fn,
    )


@overload
def stage(fn: Callable[..., Awaitable[Any]], *, name: str | None = None) -> FunctionStage: ...


@overload
def stage(
    fn: None = None, *, name: str | None = None
) -> Callable[[Callable[..., Awaitable[Any]]], FunctionStage]: ...


def stage(
    fn: Callable[..., Awaitable[Any]] | None = None, *, name: str | None = None
) -> FunctionStage | Callable[[Callable[..., Awaitable[Any]]], FunctionStage]:
    """Turn an annotated async function into a stage; usable as ``@stage`` or ``@stage(name=...)``.

    ``async def f(ctx: StepContext, a: A, b: B) -> C`` becomes a stage named ``f`` (or
    ``name``) with ``requires=(A, B)`` and ``provides=C`` (``None`` for ``-> None``).

    Raises:
        GraphError: ``fn`` is not ``async``, or a parameter or the return is unannotated
            or not a class (naming the function).
    """
    if fn is None:
        return lambda f: _function_stage(f, name)
    return _function_stage(fn, name)


def as_stage(obj: object) -> Stage:
    """Return ``obj`` if it is a stage, wrap it if it is an annotated async function.

    Raises:
        GraphError: ``obj`` is a stage class rather than an instance, or neither a stage
            nor an async function.
    """
    if isinstance(obj, type):
        raise GraphError(
            f"{obj.__qualname__} is a class; pass a stage instance, e.g. {obj.__qualname__}(...)",
            stage=obj.__qualname__,
        )
    if isinstance(obj, Stage):
        return obj
    if callable(obj) and inspect.iscoroutinefunction(obj):
        return _function_stage(obj, None)
    raise GraphError(
        f"{obj!r} is not a stage: expected an object with name, requires, provides and "
        "`async def run(ctx)`, or an annotated async function",
        stage=getattr(obj, "name", None) if isinstance(getattr(obj, "name", None), str) else None,
    )
