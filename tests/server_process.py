"""A real ``kvstep serve`` process (``python -m pipeline.cli serve``), for tests.

The process runs from the repository the tests belong to (``cwd`` and ``PYTHONPATH``),
so it serves the tree under test even when another checkout is installed.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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


@contextlib.contextmanager
def run_server(
    model: Path | str,
    log: Path,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120.0,
) -> Iterator[ServerProcess]:
    """Start ``kvstep serve`` and wait for /health; stop it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    cmd += ["--model", str(model), "--dtype", "float32", *extra]
    environ: dict[str, Any] = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p
    )
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=environ)
        server = ServerProcess(url, port, process, log)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {process.returncode}: {server.log_text()[-3000:]}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if server.health().status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not come up: {server.log_text()[-3000:]}")
                time.sleep(0.2)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
