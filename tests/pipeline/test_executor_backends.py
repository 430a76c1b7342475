"""Tests of the executor table: every executor the config accepts has a backend."""

from __future__ import annotations

from pipeline.config import EXECUTORS
from pipeline.executors import BACKENDS


class TestBackends:
    def test_every_configurable_executor_has_a_backend(self) -> None:
        """BACKENDS names exactly the executors EngineConfig accepts."""
        assert sorted(BACKENDS) == sorted(EXECUTORS)
