"""kvstep's events fit the host application's logging; the CLI configures its own output.

An application that configured only stdlib logging gets kvstep's events through
``logging.getLogger("kvstep")`` and nothing on stdout; one that configured nothing sees
nothing at all; one that configured structlog gets them through structlog.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from connectors.testing import Fault
from pipeline.config import EngineConfig, SamplingParams
from pipeline.engine.llm import LLM
from pipeline.logger import LOGGER_NAME, cli_logging, get_logger

ROOT = Path(__file__).resolve().parents[2]

APP = """
import logging, sys
if sys.argv[1] == "stdlib":
    logging.basicConfig(level=logging.WARNING)
from connectors.testing import Fault
from pipeline.config import EngineConfig, SamplingParams
from pipeline.engine.llm import LLM

fault = Fault(call="start_load_kv", action="raise", step=1)
config = EngineConfig(
    model="builtin:tiny",
    connector="faulty",
    connector_options={"inner": "recording", "faults": [fault.to_dict()]},
    **({"executor": sys.argv[2], "world_size": 1} if len(sys.argv) > 2 else {}),
)
with LLM(config) as llm:
    llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=3))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
assert out[0].finished
"""


def _faulty_config() -> EngineConfig:
    fault = Fault(call="start_load_kv", action="raise", step=1)
    return EngineConfig(
        model="builtin:tiny",
        connector="faulty",
        connector_options={"inner": "recording", "faults": [fault.to_dict()]},
    )


def _run_app(mode: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSTEP_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-c", APP, mode, *extra],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
        check=False,
    )


@pytest.fixture
def unconfigured() -> Iterator[None]:
    """Start from an unconfigured structlog and leave it as it was found."""
    was = structlog.is_configured()
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        yield
    finally:
        if was:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


class TestHostApplications:
    def test_stdlib_application_gets_events_through_logging(self) -> None:
        """basicConfig(WARNING): nothing on stdout; step_failed on stderr as logger kvstep."""
        proc = _run_app("stdlib")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == ""
        lines = proc.stderr.splitlines()
        failed = [line for line in lines if line.startswith("ERROR:kvstep:step_failed")]
        assert failed, proc.stderr[-3000:]
        assert "step_id=1" in failed[0] and "FaultInjected" in failed[0]
        assert "model_loaded" not in proc.stderr  # info: below the application's level

    @pytest.mark.parametrize("executor", [None, "multiproc"])
    def test_unconfigured_application_sees_nothing(self, executor: str | None) -> None:
        """No logging configured: a failing step prints nothing on stdout or stderr, nor
        do the worker processes of the multiproc executor."""
        proc = _run_app("none", *([executor] if executor else []))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (proc.stdout, proc.stderr) == ("", "")

    def test_structlog_application_gets_events_through_structlog(
        self, unconfigured: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An application that configured structlog gets kvstep's events there, not twice."""
        caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
        with structlog.testing.capture_logs() as entries, LLM(_faulty_config()) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        failed = [e for e in entries if e["event"] == "step_failed"]
        assert failed and failed[0]["log_level"] == "error" and failed[0]["step_id"] == 1
        assert any(e["event"] == "step" and e["log_level"] == "debug" for e in entries)
        assert not [r for r in caplog.records if r.name == LOGGER_NAME]

    def test_stdlib_records_carry_fields_and_context(
        self, unconfigured: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Stdlib records: logger kvstep, message 'event k=v', fields on record.kvstep,
        step records at debug once the application enables it; structlog untouched."""
        caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
        with LLM(_faulty_config()) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        records = [r for r in caplog.records if r.name == LOGGER_NAME]
        failed = [r for r in records if r.kvstep["event"] == "step_failed"]  # type: ignore[attr-defined]
        assert failed and failed[0].levelno == logging.ERROR
        assert failed[0].getMessage().startswith("step_failed step_id=1 ")
        steps = [r for r in records if r.kvstep["event"] == "step"]  # type: ignore[attr-defined]
        assert steps and all(r.levelno == logging.DEBUG for r in steps)
        assert not structlog.is_configured()

    def test_nothing_is_rendered_below_the_level(
        self, unconfigured: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A disabled level costs a check, not a rendering of the fields."""
        logging.getLogger(LOGGER_NAME).setLevel(logging.WARNING)
        monkeypatch.setattr("pipeline.logger._render", lambda *a: pytest.fail("rendered"))
        try:
            get_logger().info("quiet", value=1)
            get_logger().debug("quieter", value=2)
        finally:
            logging.getLogger(LOGGER_NAME).setLevel(logging.NOTSET)

    def test_cli_logging_is_restored(self) -> None:
        """The CLI's handler and level are gone after its block."""
        logger = logging.getLogger(LOGGER_NAME)
        handlers, level = list(logger.handlers), logger.level
        with cli_logging(logging.INFO):
            assert len(logger.handlers) == len(handlers) + 1
            assert os.environ["KVSTEP_LOG_LEVEL"] == "INFO"
        assert (logger.handlers, logger.level) == (handlers, level)
        assert "KVSTEP_LOG_LEVEL" not in os.environ


class TestServeOutput:
    def test_serve_prints_ready_access_and_shutdown_lines(self, tmp_path: Path) -> None:
        """kvstep serve: 'listening on http://HOST:PORT' once ready, one access line per
        request with --access-log, 'shutdown complete' after SIGTERM."""
        pytest.importorskip("uvicorn")
        from server_process import free_port

        port = free_port()
        log = tmp_path / "serve.log"
        cmd = [sys.executable, "-m", "pipeline.cli", "serve", "--model", "builtin:tiny"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--access-log"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with log.open("wb") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
            try:
                deadline = time.monotonic() + 120
                while f"listening on http://127.0.0.1:{port}" not in log.read_text():
                    assert process.poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.1)
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
            finally:
                process.terminate()
                process.wait(timeout=60)
        text = log.read_text()
        assert '"GET /health HTTP/1.1" 200' in text
        assert "shutdown complete" in text
