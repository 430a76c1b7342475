"""``EngineConfig.logits_processors``: logits stages named in the configuration.

vLLM users configure custom logits processors as ``logits_processors=[cls or
"module:Class"]``; in kvstep each entry is a :class:`~pipeline.logits.LogitsStage`
subclass (or its import path, ``"module:Class"`` or ``"module.Class"``) that is built
with no arguments and inserted after the built-in ``logits`` stage, in order: sugar for
``worker_graph=lambda g: g.insert_after("logits", Cls())``.

* :func:`check_logits_processors`: what ``EngineConfig`` checks at construction (the
  shape of each entry, nothing imported); with worker processes each class becomes its
  ``"module:qualname"`` path, the form that crosses to the workers.
* :func:`resolve_logits_processors`: the stages themselves, built where the worker graph
  is built (it imports the paths).
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, TypeAlias

from pipeline.errors import InvalidConfigError, short_repr
from pipeline.imports import import_path, resolve_import_path

if TYPE_CHECKING:
    from pipeline.config import EngineConfig
    from pipeline.logits import LogitsStage

__all__ = [
    "LogitsProcessorEntry",
    "check_logits_processors",
    "logits_processor_path",
    "resolve_logits_processors",
]

#: One entry of ``EngineConfig.logits_processors``: a class, or its import path.
LogitsProcessorEntry: TypeAlias = type | str

_FIELD = "logits_processors"
_SHAPE = (
    'must be a LogitsStage subclass or its import path, "module:Class" or "module.Class" '
    "(dotted Python identifiers)"
)


def _dotted(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def _is_path(text: str) -> bool:
    """Whether ``text`` reads ``module:qual.name`` or ``package.module.Name``."""
    module, colon, qualname = text.partition(":")
    if colon:
        return _dotted(module) and _dotted(qualname)
    return "." in text and _dotted(text)


def logits_processor_path(entry: LogitsProcessorEntry, what: str = _FIELD) -> str:
    """``entry`` as the import path a worker process resolves: a string as it is, a
    class as ``"module:qualname"`` (:func:`pipeline.imports.import_path`).

    Raises:
        InvalidConfigError: A class that its path does not import: defined in a
            function, in ``__main__`` (a worker's ``__main__`` is not the caller's
            script), or no longer what its module holds under that name.
    """
    return entry if isinstance(entry, str) else import_path(entry, what=what)


def check_logits_processors(
    value: object, *, by_path: bool = False
) -> tuple[LogitsProcessorEntry, ...]:
    """``value`` as ``EngineConfig.logits_processors``: a list or tuple of classes and
    import paths. Nothing is imported: a path is checked for its shape, a class for
    subclassing ``LogitsStage`` (which its module imported). Pure.

    Args:
        value: The field's value.
        by_path: Turn each class into its path (:func:`logits_processor_path`): the
            entries must cross to worker processes (``executor`` ``multiproc`` or ``ray``).

    Raises:
        InvalidConfigError: Not a list or tuple, an entry neither a ``LogitsStage``
            subclass nor a string of that shape, or (``by_path``) a class not importable
            by its path; names the entry (``logits_processors[1]``).
    """
    if not isinstance(value, list | tuple):
        raise InvalidConfigError(
            _FIELD,
            value,
            'must be a list of LogitsStage subclasses or import paths ("module:Class")',
        )
    base = getattr(sys.modules.get("pipeline.logits"), "LogitsStage", None)
    entries: list[LogitsProcessorEntry] = []
    for i, entry in enumerate(value):
        what = f"{_FIELD}[{i}]"
        if isinstance(entry, str):
            if not _is_path(entry):
                raise InvalidConfigError(what, entry, _SHAPE)
        elif not isinstance(entry, type):
            raise InvalidConfigError(what, entry, _SHAPE)
        elif base is None or not issubclass(entry, base):  # no subclass without its base
            raise InvalidConfigError(what, entry, "must be a subclass of pipeline.LogitsStage")
        entries.append(logits_processor_path(entry, what) if by_path else entry)
    return tuple(entries)


def _import(what: str, path: str) -> object:
    """The object ``path`` names: ``module:qual.name`` imports ``module``;
    ``a.b.Name`` imports ``a.b``."""
    module, _, name = path.rpartition(".")
    target = path if ":" in path else f"{module}:{name}"
    try:
        return resolve_import_path(target, what=what)
    except InvalidConfigError as exc:
        raise InvalidConfigError(what, path, f"cannot be imported: {exc.allowed}") from exc
    except Exception as exc:  # the module's own code raised while it was imported
        raise InvalidConfigError(
            what,
            path,
            f"cannot be imported: its module raised {short_repr(exc, 160)}",
        ) from exc


def _build(what: str, entry: LogitsProcessorEntry, cls: object) -> LogitsStage:
    """``cls()``, once ``cls`` is known to be a concrete ``LogitsStage`` built with no
    arguments."""
    from pipeline.logits import LogitsStage  # the logits seam imports the graph kernel

    if not isinstance(cls, type) or not issubclass(cls, LogitsStage):
        kind = f"the class {cls.__qualname__}" if isinstance(cls, type) else type(cls).__name__
        raise InvalidConfigError(
            what, entry, f"must be a subclass of pipeline.LogitsStage; it is {kind}"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise InvalidConfigError(what, entry, f"is abstract: it must implement {missing}")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise InvalidConfigError(
            what,
            entry,
            f"needs arguments {inspect.signature(cls)}: a logits processor is built with "
            "none (to pass some, insert an instance: worker_graph=lambda g: "
            'g.insert_after("logits", Cls(...)))',
        ) from None
    except ValueError:  # no signature to read: try the call itself
        pass
    try:
        stage: LogitsStage = cls()
    except Exception as exc:
        raise InvalidConfigError(
            what, entry, f"raised {short_repr(exc, 160)} when built with no arguments"
        ) from exc
    return stage


def resolve_logits_processors(config: EngineConfig) -> tuple[LogitsStage, ...]:
    """The stages of ``config.logits_processors``, in order, each built with no arguments.

    Called where a worker graph is built (once per rank, at start; it may import
    modules, so it blocks for as long as they take to import). Each path is imported,
    each class checked to subclass :class:`pipeline.logits.LogitsStage` and built.

    Raises:
        InvalidConfigError: An entry that cannot be imported, is not a ``LogitsStage``
            subclass, is abstract, needs arguments or raises when built, or whose stage
            has no name or the name of an earlier one; names the entry (``logits_processors[0]``)
            and why.
    """
    stages: list[LogitsStage] = []
    names: dict[str, int] = {}
    for i, entry in enumerate(config.logits_processors):
        what = f"{_FIELD}[{i}]"
        cls = entry if isinstance(entry, type) else _import(what, entry)
        stage = _build(what, entry, cls)
        name = getattr(stage, "name", None)
        if not isinstance(name, str) or not name:
            raise InvalidConfigError(
                what, entry, "has no stage name: set the class attribute name (a str)"
            )
        if name in names:
            raise InvalidConfigError(
                what,
                entry,
                f"builds a stage named {name!r}, as {_FIELD}[{names[name]}] does: "
                "stage names must be unique",
            )
        names[name] = i
        stages.append(stage)
    return tuple(stages)
