"""Tests of import order: any of the packages, or a deep module, can be imported first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FIRST_IMPORTS = (
    "pipeline",
    "stages",
    "connectors",
    "connectors.base",
    "connectors.testing",
    "stages.forward.model",
    "stages.schedule.scheduler",
    "pipeline.server",
    "pipeline.cli",
    "pipeline.executors.worker_proc",
)


class TestImportOrder:
    @pytest.mark.parametrize("module", FIRST_IMPORTS)
    def test_module_imports_first_in_a_fresh_interpreter(self, module: str) -> None:
        """Importing the module before anything else of kvstep succeeds."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
