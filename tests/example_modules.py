"""Helper for tests (not a test file): an ``examples/`` script imported as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str, module_name: str) -> ModuleType:
    """``examples/<name>`` imported under ``module_name`` (a fresh module each call)."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
