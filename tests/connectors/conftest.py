"""Fixtures of the connector tests: a real ``redis-server`` on a free loopback port.

The redis tests skip (with the reason) only when ``redis-server`` is not on PATH or the
``redis`` package is missing; nothing here affects the other connector tests.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import free_port


class RedisServer:
    """A ``redis-server`` subprocess on a fixed loopback port that tests can kill and
    restart (same port, empty data: persistence is off)."""

    def __init__(self, executable: str, workdir: Path) -> None:
        self.executable = executable
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, timeout: float = 5.0):  # -> redis.Redis
        """A new binary client (the caller closes it)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout)

    def start(self) -> None:
        """Start the server and wait until it answers PING (at most 10 s)."""
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        args += ["--enable-debug-command", "local"]  # DEBUG SLEEP: the slow-server test
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.workdir
        )
        deadline = time.monotonic() + 10.0
        while True:
            try:
                with self.client(timeout=0.5) as client:
                    if client.ping():
                        return
            except Exception as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from exc
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server and reap it (its data is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def restart(self) -> None:
        """Kill, then start again on the same port."""
        self.kill()
        self.start()

    def ensure_running(self) -> None:
        """Start it again if a test left it stopped."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A session's ``redis-server``; skips when it (or the ``redis`` package) is absent."""
    pytest.importorskip("redis", reason="the redis package is not installed")
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = RedisServer(executable, tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The running server's URL (restarted first if a previous test killed it)."""
    redis_server.ensure_running()
    return redis_server.url
