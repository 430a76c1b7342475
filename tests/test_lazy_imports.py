"""Tests of what an import loads: the graph kernel and the connector API without torch or
the engine, and ``pipeline``'s public names imported on first use."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline

HEAVY = ("torch", "pipeline.engine", "pipeline.executors", "stages")


def _run_fresh(code: str) -> None:
    """Run ``code`` in a fresh interpreter; fail with its stderr if it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def _type_checking_imports() -> dict[str, tuple[str, str | None]]:
    """Each name imported in ``pipeline/__init__.py``'s ``if TYPE_CHECKING:`` block →
    (its module, the name it is imported ``as``)."""
    tree = ast.parse(Path(pipeline.__file__).read_text(encoding="utf-8"))
    imports: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
                assert statement.module is not None
                for alias in statement.names:
                    imports[alias.name] = (statement.module, alias.asname)
    return imports


class TestCheapImports:
    @pytest.mark.parametrize("module", ["pipeline.kernel", "connectors.base", "pipeline"])
    def test_loads_neither_torch_nor_the_engine(self, module: str) -> None:
        """Importing the module first loads no torch, engine, executors or stages."""
        _run_fresh(
            f"import sys, {module}\n"
            f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "assert loaded == [], loaded\n"
        )

    def test_engine_name_imports_the_engine_on_first_use(self) -> None:
        """``pipeline.LLM`` imports the engine when first read and is the engine's LLM;
        ``from pipeline import ...`` of several names works too."""
        _run_fresh(
            "import sys, pipeline\n"
            "assert 'pipeline.engine' not in sys.modules\n"
            "llm = pipeline.LLM\n"
            "import pipeline.engine\n"
            "assert llm is pipeline.engine.LLM\n"
            "from pipeline import LLM, EngineConfig, SamplingParams, StepGraph\n"
            "from pipeline.config import EngineConfig as config_class\n"
            "assert LLM is llm and EngineConfig is config_class\n"
        )

    def test_dir_lists_every_public_name_before_any_is_imported(self) -> None:
        """``dir(pipeline)`` holds all of ``__all__`` while the engine is still unloaded."""
        _run_fresh(
            "import sys, pipeline\n"
            "missing = sorted(set(pipeline.__all__) - set(dir(pipeline)))\n"
            "assert missing == [], missing\n"
            "assert 'pipeline.engine' not in sys.modules\n"
        )

    def test_unknown_name_is_an_attribute_error_that_imports_nothing(self) -> None:
        """A name neither public nor a submodule raises AttributeError naming it, and
        asking for it (``hasattr``, as tools probe) loads no engine."""
        _run_fresh(
            "import sys, pipeline\n"
            "assert not hasattr(pipeline, 'no_such_name')\n"
            "try:\n"
            "    pipeline.no_such_name\n"
            "except AttributeError as error:\n"
            "    assert 'no_such_name' in str(error), error\n"
            "else:\n"
            "    raise AssertionError('no AttributeError')\n"
            "assert 'pipeline.engine' not in sys.modules\n"
        )


class TestLazyExports:
    def test_every_public_name_is_its_modules_object(self) -> None:
        """Each name of ``__all__`` resolves to the very object its module defines."""
        wrong = [
            name
            for name, module in pipeline._EXPORTS.items()
            if getattr(pipeline, name) is not getattr(importlib.import_module(module), name)
        ]
        assert wrong == []
        assert sorted(pipeline.__all__) == sorted(pipeline._EXPORTS)

    def test_type_checkers_see_the_same_names(self) -> None:
        """The ``TYPE_CHECKING`` block imports exactly the names of ``_EXPORTS``, each
        from the same module, each as itself (an explicit re-export under strict mypy)."""
        imports = _type_checking_imports()
        expected = {name: (module, name) for name, module in pipeline._EXPORTS.items()}
        assert imports == expected
