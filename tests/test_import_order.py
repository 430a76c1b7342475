"""Tests of import order: any of the packages, or a deep module, can be imported first."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

FIRST_IMPORTS = (
    "pipeline",
    "stages",
    "connectors",
    "connectors.base",
    "connectors.testing",
    "stages.model.model",
    "stages.scheduler.scheduler",
    "pipeline.server",
    "pipeline.cli",
    "pipeline.executors.remote_worker",
)


@pytest.fixture(scope="module")
def fresh_interpreters() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """One fresh interpreter per module of FIRST_IMPORTS, each running only
    ``import MODULE``, all started at once (each is still its own process importing its
    module first; they only overlap in time, instead of paying each start in turn)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = {
        module: subprocess.Popen(
            [sys.executable, "-c", f"import {module}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for module in FIRST_IMPORTS
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


class TestImportOrder:
    @pytest.mark.parametrize("module", FIRST_IMPORTS)
    def test_module_imports_first_in_a_fresh_interpreter(
        self, module: str, fresh_interpreters: dict[str, subprocess.Popen[str]]
    ) -> None:
        """Importing the module before anything else of kvstep succeeds."""
        proc = fresh_interpreters[module]
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
