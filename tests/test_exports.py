"""Tests of the packages' export lists: every public name is exported exactly once."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections import Counter
from types import ModuleType

import pytest

PACKAGES = ("pipeline", "stages", "connectors")


def _exports(name: str) -> list[str]:
    """The package's ``__all__``; skips the test while the package has none yet."""
    module: ModuleType = importlib.import_module(name)
    names = getattr(module, "__all__", None)
    if names is None:
        pytest.skip(f"{name}/__init__.py has no __all__ yet")
    return list(names)


class TestExportLists:
    @pytest.mark.parametrize("package", PACKAGES)
    def test_every_exported_name_exists(self, package: str) -> None:
        """Each name in __all__ resolves to an attribute of the package."""
        module = importlib.import_module(package)
        missing = [n for n in _exports(package) if not hasattr(module, n)]
        assert missing == []

    @pytest.mark.parametrize("package", PACKAGES)
    def test_no_duplicates(self, package: str) -> None:
        """__all__ lists each name once."""
        counts = Counter(_exports(package))
        assert [n for n, c in counts.items() if c > 1] == []

    @pytest.mark.parametrize("package", PACKAGES)
    def test_only_strings(self, package: str) -> None:
        """__all__ holds names (strings), not objects."""
        assert all(isinstance(n, str) for n in _exports(package))

    def test_no_name_is_exported_by_two_packages(self) -> None:
        """A public name belongs to exactly one package's __all__."""
        owners: dict[str, list[str]] = {}
        for package in PACKAGES:
            module = importlib.import_module(package)
            for name in getattr(module, "__all__", ()):
                owners.setdefault(name, []).append(package)
        shared = {n: p for n, p in owners.items() if len(p) > 1}
        assert shared == {}


class TestConnectorsExports:
    @pytest.mark.parametrize(
        "module", ["connectors.base", "connectors.lifecycle", "connectors.registry"]
    )
    def test_api_modules_are_re_exported(self, module: str) -> None:
        """Every public name of the API modules is re-exported by the package."""
        package = set(_exports("connectors"))
        assert set(importlib.import_module(module).__all__) - package == set()

    def test_testing_is_a_separate_import(self) -> None:
        """Importing connectors does not import connectors.testing; it exports nothing of it."""
        code = "import sys, connectors\nassert 'connectors.testing' not in sys.modules\n"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        testing = importlib.import_module("connectors.testing")
        assert set(testing.__all__).isdisjoint(_exports("connectors"))
