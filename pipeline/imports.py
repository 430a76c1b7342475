"""Import paths (``"package.module:qualname"``): how code is named across processes.

Worker processes never receive pickled objects, so whatever they must build themselves
(a custom worker graph function, a connector's classes, a metadata class) travels as the
import path of a module-level object and is imported again on the other side.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.errors import InvalidConfigError

__all__ = ["import_path", "resolve_import_path"]


def import_path(obj: Any, *, what: str) -> str:
    """The ``"module:qualname"`` that imports ``obj`` again in another process.

    Args:
        obj: A module-level function or class.
        what: What ``obj`` is, for the error message (``"worker_graph"``, ...).

    Raises:
        InvalidConfigError: ``obj`` is a lambda, a nested function or class, or lives in
            ``__main__`` (another process cannot import it), or importing the path does
            not give ``obj`` back.
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    allowed = (
        "a module-level function or class of an importable module (not __main__, "
        "not a lambda or nested definition), or a 'module:qualname' string"
    )
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise InvalidConfigError(what, obj, f"must be {allowed}")
    path = f"{module}:{qualname}"
    try:
        found = resolve_import_path(path, what=what)
    except InvalidConfigError:
        found = None
    if found is not obj:
        raise InvalidConfigError(what, obj, f"must be {allowed}; {path} does not import it")
    return path


def resolve_import_path(path: str, *, what: str) -> Any:
    """Import ``"module:qualname"`` and return the object.

    Raises:
        InvalidConfigError: A malformed path, or the module or attribute is missing.
    """
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise InvalidConfigError(what, path, "must be an import path 'package.module:qualname'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidConfigError(what, path, f"its module does not import: {exc}") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise InvalidConfigError(
                what, path, f"module {module_name} has no attribute {qualname}"
            ) from exc
    return obj
