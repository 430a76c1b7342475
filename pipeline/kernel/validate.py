"""Build-time checks of one stage's declaration, shared by the graph builder.

Everything here runs when a graph is built, never per step. Each failure raises
:class:`~pipeline.errors.GraphError` naming the stage and, where there is one, the type.
"""

from __future__ import annotations

import inspect
import math
import typing
from typing import Any

from pipeline.errors import GraphError
from pipeline.kernel.stage import Finalizer, FunctionStage, Stage, is_finalizer, lane

__all__ = ["check_stage", "has_drain", "type_name"]


def type_name(t: object) -> str:
    """A short, readable name for an artifact type (``None`` for no type)."""
    if t is None or t is type(None):
        return "None"
    return str(getattr(t, "__qualname__", t))


def has_drain(finalizer: Stage) -> bool:
    """Whether a finalizer overrides :meth:`Finalizer.run` (the runner skips a no-op drain)."""
    return getattr(type(finalizer), "run", None) is not Finalizer.run


def check_stage(s: Stage) -> None:
    """Check one stage's declaration.

    Raises:
        GraphError: The name is not a non-empty string; ``requires`` is not a tuple of
            classes; ``provides`` is not a class or ``None``; ``run`` is not an async
            method; ``run``'s return annotation disagrees with ``provides``; or, for a
            finalizer, it requires or provides anything, ``finalize`` is missing or
            async, ``timeout_s`` is not a finite positive number, ``mandatory`` not a bool.
    """
    name = s.name
    if not isinstance(name, str) or not name:
        raise GraphError(f"stage {s!r} has name {name!r}; a name is a non-empty string")
    requires = s.requires
    if not isinstance(requires, tuple) or not all(isinstance(t, type) for t in requires):
        raise GraphError(
            f"stage {name!r} has requires={requires!r}; it must be a tuple of artifact classes",
            stage=name,
        )
    provides = s.provides
    if provides is not None and not isinstance(provides, type):
        raise GraphError(
            f"stage {name!r} has provides={provides!r}; it must be an artifact class or None",
            stage=name,
            artifact=type_name(provides),
        )
    if not inspect.iscoroutinefunction(getattr(s, "run", None)):
        raise GraphError(f"stage {name!r}: `run` must be an `async def` method", stage=name)
    if is_finalizer(s):
        _check_finalizer(s, name)
    if lane(s) is not None:
        _check_compute(s, name)
    if not isinstance(s, FunctionStage):
        _check_return_annotation(s, name, provides)


def _check_return_annotation(s: Stage, name: str, provides: type | None) -> None:
    """Compare ``run``'s resolved return annotation with ``provides``.

    Skipped when ``run`` is unannotated, annotated ``Any``, or its annotations cannot be
    resolved at runtime (e.g. names imported only under ``TYPE_CHECKING``).
    """
    try:
        hints = typing.get_type_hints(type(s).run)
    except Exception:
        return
    if "return" not in hints:
        return
    ret: Any = hints["return"]
    if ret is Any:
        return
    if provides is None:
        agrees = ret is type(None)
    else:
        agrees = isinstance(ret, type) and issubclass(ret, provides)
    if not agrees:
        raise GraphError(
            f"stage {name!r} declares provides={type_name(provides)} but its `run` is "
            f"annotated to return {type_name(ret)}; make them agree",
            stage=name,
            artifact=type_name(provides),
        )


def _check_compute(s: Stage, name: str) -> None:
    """A compute stage (``runs_on``) has a synchronous ``compute(ctx)`` and, if it has a
    ``hop``, an ``async`` one; it is not a finalizer."""
    compute = getattr(s, "compute", None)
    if not callable(compute) or inspect.iscoroutinefunction(compute):
        raise GraphError(
            f"stage {name!r} has runs_on={getattr(s, 'runs_on', None)!r}: its "
            "`compute(ctx)` must be a synchronous method (it runs on that thread)",
            stage=name,
        )
    hop = getattr(s, "hop", None)
    if hop is not None and not inspect.iscoroutinefunction(hop):
        raise GraphError(
            f"stage {name!r}: `hop(ctx, work)` must be an `async def` method", stage=name
        )
    if is_finalizer(s):
        raise GraphError(
            f"finalizer {name!r} has runs_on; a finalizer runs on the event loop", stage=name
        )


def _check_finalizer(s: Stage, name: str) -> None:
    if s.requires or s.provides is not None:
        what = (
            f"requires {', '.join(type_name(t) for t in s.requires)}"
            if s.requires
            else f"provides {type_name(s.provides)}"
        )
        raise GraphError(
            f"finalizer {name!r} {what}; finalizers declare no artifacts "
            "(read them with ctx.maybe(T))",
            stage=name,
            artifact=type_name(s.requires[0] if s.requires else s.provides),
        )
    finalize = getattr(s, "finalize", None)
    if not callable(finalize) or inspect.iscoroutinefunction(finalize):
        raise GraphError(
            f"finalizer {name!r}: `finalize(ctx)` must be a synchronous method", stage=name
        )
    timeout = getattr(s, "timeout_s", None)
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise GraphError(
            f"finalizer {name!r} has timeout_s={timeout!r}; it must be a finite number > 0",
            stage=name,
        )
    if not isinstance(getattr(s, "mandatory", False), bool):
        raise GraphError(
            f"finalizer {name!r} has mandatory={getattr(s, 'mandatory', None)!r}; "
            "it must be a bool",
            stage=name,
        )
