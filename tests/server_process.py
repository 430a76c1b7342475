"""A real ``kvstep serve`` process (``python -m pipeline.cli serve``), for tests.

The process runs from the repository the tests belong to (``cwd`` and ``PYTHONPATH``),
so it serves the tree under test even when another checkout is installed.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """A running server: its URL, process and log file."""

    def __init__(self, url: str, port: int, process: subprocess.Popen[bytes], log: Path):
        self.url = url
        self.port = port
        self.process = process
        self.log = log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """The multiproc worker PIDs the server logged at start-up."""
        match = re.search(r"workers_ready.*?pids=\[([0-9, ]+)\]", self.log_text())
        return [int(p) for p in match.group(1).split(",")] if match else []

    def health(self, **headers: str) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10, headers=headers)

    def wait_healthy(self, deadline: float) -> None:
        """Return once ``/health`` answers 200; ``RuntimeError`` (with the log's tail)
        when the process exits first or ``deadline`` (``time.monotonic``) passes."""
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}: {self.log_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if self.health().status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up: {self.log_text()[-3000:]}")
            time.sleep(0.2)


@contextlib.contextmanager
def launch(
    command: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """Start ``python -m pipeline.cli COMMAND`` on a free loopback port, without waiting
    for it (:meth:`ServerProcess.wait_healthy`); stop it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.cli", command, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *args]
    environ: dict[str, Any] = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p
    )
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=environ)
        try:
            yield ServerProcess(url, port, process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def run_server(
    model: Path | str,
    log: Path,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120.0,
) -> Iterator[ServerProcess]:
    """Start ``kvstep serve`` and wait for /health; stop it on exit."""
    args = ["--model", str(model), "--dtype", "float32", *extra]
    with launch("serve", args, log, env) as server:
        server.wait_healthy(time.monotonic() + start_timeout_s)
        yield server
