"""Shared fixtures: tiny random Hugging Face checkpoints and the engine leak check."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
from checkpoints import TINY, build_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A CPU model's linear kernel is chosen by timing the candidates at load
# (stages.model.linear_kernels), so two loads may choose differently: a test that reads a
# projection's weight (a prepacked one has none) or compares two processes' logits would
# pass or fail by the machine's noise (test_tensor_parallel's shard-layout test did; it now
# forces mkl itself, as a test that reads loaded weights must). The
# suite pins the kernel, for its worker processes too; the kernel tests force each kernel,
# and auto, themselves.
os.environ.setdefault("KVSTEP_LINEAR_KERNEL", "mkl")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--async-scheduling",
        action="store_true",
        help="run every engine built in this process with EngineConfig.async_scheduling "
        "on unless a test sets it (its default is off); .ci/run runs the engine tests "
        "both ways",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--async-scheduling"):
        from pipeline.config import EngineConfig

        defaults = EngineConfig.__init__.__kwdefaults__
        assert defaults is not None and defaults["async_scheduling"] is False
        defaults["async_scheduling"] = True


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random checkpoint per supported architecture, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: build_checkpoint(kind, root / kind) for kind in TINY}


@pytest.fixture(scope="session")
def llama_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def assert_no_leaks(report: dict[str, int]) -> None:
    """The leak oracle: nothing in use, nothing pending, nothing bound."""
    leaks = {k: v for k, v in report.items() if k != "cached_blocks" and v}
    assert not leaks, f"leaked engine state: {leaks}"


@pytest.fixture
def leak_check() -> Callable[[dict[str, int]], None]:
    return assert_no_leaks


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Iterator[None]:
    """A test that configured structlog (``structlog.testing.capture_logs`` does, and
    leaves ``structlog.is_configured()`` true) must not send the next tests' kvstep events
    to structlog instead of the stdlib logger their ``caplog`` reads."""
    yield
    if not _STRUCTLOG_CONFIGURED and structlog.is_configured():
        structlog.reset_defaults()


_STRUCTLOG_CONFIGURED = structlog.is_configured()  # before any test ran


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """builtin:tiny caches under KVSTEP_CACHE_DIR; share one per session, off $HOME."""
    monkeypatch.setenv("KVSTEP_CACHE_DIR", str(_session_cache(tmp_path_factory)))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache_for_wider_fixtures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The same cache for module- and session-scoped fixtures, which start before a
    test's own fixtures: an engine they start shares the tests' cache (its builtin
    model, and the nixl transfer key file: a producer and a consumer of one test run
    must find the same key)."""
    before = os.environ.get("KVSTEP_CACHE_DIR")
    os.environ["KVSTEP_CACHE_DIR"] = str(_session_cache(tmp_path_factory))
    yield
    if before is None:
        os.environ.pop("KVSTEP_CACHE_DIR", None)
    else:
        os.environ["KVSTEP_CACHE_DIR"] = before


_CACHE: list[Path] = []


def _session_cache(factory: pytest.TempPathFactory) -> Path:
    if not _CACHE:
        _CACHE.append(factory.mktemp("kvstep-cache"))
    return _CACHE[0]


@pytest.fixture(autouse=True)
def _leak_oracle(monkeypatch: pytest.MonkeyPatch):
    """After every engine test: each engine closed in it had leaked nothing.

    ``AsyncEngine`` aborts whatever is still in flight before it closes its core, so at
    ``EngineCore.aclose`` every block must be free and nothing pending or bound.
    """
    from pipeline.engine.core import EngineCore

    reports: list[dict[str, int]] = []
    original = EngineCore.aclose

    async def checked_aclose(self: EngineCore) -> None:
        if not self._closed:
            reports.append(self.leak_report())
        await original(self)

    monkeypatch.setattr(EngineCore, "aclose", checked_aclose)
    yield
    for report in reports:
        assert_no_leaks(report)
