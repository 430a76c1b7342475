"""Issue 10's connection-level server findings against a real server process: slow and
vanishing clients (7), a killed multiproc worker (3) and the API key flag (5)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

from server_process import ServerProcess, run_server

BODY = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0}
LIMITS = ["--header-timeout", "1", "--body-timeout", "1", "--max-model-len", "256"]
LIMITS += ["--limit-concurrency", "4"]


@pytest.fixture(scope="module")
def server(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """An in-process-executor server: 1 s header and body timeouts, 4 connections."""
    log = tmp_path_factory.mktemp("limits") / "server.log"
    with run_server(llama_path, log, LIMITS) as proc:
        yield proc


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed ``sock`` within ``seconds`` (reading what it sends)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


class TestSlowClients:
    def test_slowloris_headers_are_cut_off(self, server: ServerProcess) -> None:
        """Finding 7: headers sent a byte at a time are cut off; others are served meanwhile."""
        sock = _connect(server)
        cut_off = threading.Event()

        def drip() -> None:
            request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
            try:
                for byte in request:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
            except OSError:
                cut_off.set()

        dripper = threading.Thread(target=drip, daemon=True)
        start = time.monotonic()
        dripper.start()
        served = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30)
        sock.settimeout(5)
        closed = _closed_within(sock, 6.0)
        elapsed = time.monotonic() - start
        sock.close()
        assert served.status_code == 200
        assert closed and elapsed < 8.0

    def test_slow_body_is_408(self, server: ServerProcess) -> None:
        """Finding 7: a body that does not arrive within the body timeout is a 408."""
        sock = _connect(server)
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        sock.sendall(head)
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after it
            reply += chunk
        sock.close()
        assert reply.startswith(b"HTTP/1.1 408")
        assert b'"request_timeout"' in reply

    def test_disconnect_mid_body_is_one_log_line(self, server: ServerProcess) -> None:
        """Finding 7: a client gone mid-body is one log line, no traceback, no leak."""
        before = server.log_text()
        sock = _connect(server)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b"{" * 10
        )
        time.sleep(0.2)
        sock.close()
        deadline = time.monotonic() + 10
        while "client_disconnected_mid_body" not in server.log_text()[len(before) :]:
            assert time.monotonic() < deadline, server.log_text()[len(before) :]
            time.sleep(0.05)
        time.sleep(0.3)
        new = server.log_text()[len(before) :]
        assert new.count("client_disconnected_mid_body") == 1
        assert "Traceback" not in new and "Exception in ASGI" not in new
        assert server.health().json()["requests"] == 0

    def test_idle_connections_past_the_limit_get_503(self, server: ServerProcess) -> None:
        """Finding 7: past --limit-concurrency a request gets 503 at once, then service resumes."""
        idle = [_connect(server) for _ in range(4)]
        time.sleep(0.1)
        try:
            refused = httpx.get(f"{server.url}/v1/models", timeout=10)
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert refused.status_code == 503
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200


class TestAuthFlag:
    def test_api_key_from_the_environment(self, llama_path: Path, tmp_path: Path) -> None:
        """Finding 5: a server started with $KVSTEP_API_KEY refuses keyless requests."""
        key = "env-key-123"
        env = {"KVSTEP_API_KEY": key}
        with run_server(llama_path, tmp_path / "auth.log", env=env) as proc:
            keyless = httpx.post(f"{proc.url}/v1/completions", json=BODY, timeout=30)
            auth = {"Authorization": f"Bearer {key}"}
            keyed = httpx.post(f"{proc.url}/v1/completions", json=BODY, headers=auth, timeout=30)
            assert proc.health().status_code == 200
            log = proc.log_text()
        assert (keyless.status_code, keyed.status_code) == (401, 200)
        assert key not in log


class TestWorkerDeath:
    def test_killed_worker_makes_health_503(self, llama_path: Path, tmp_path: Path) -> None:
        """Finding 3: SIGKILL the multiproc worker and /health turns 503 "engine is dead"."""
        extra = ["--executor", "multiproc", "--world-size", "1", "--max-model-len", "256"]
        with run_server(llama_path, tmp_path / "mp.log", extra) as proc:
            pids = proc.worker_pids()
            assert pids, proc.log_text()[-2000:]
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 20
            while (health := proc.health()).status_code == 200:
                assert time.monotonic() < deadline, "health stayed 200 with a dead worker"
                time.sleep(0.1)
            resp = httpx.post(f"{proc.url}/v1/completions", json=BODY, timeout=30)
        assert health.status_code == 503
        assert health.json()["reason"] == "engine is dead"
        assert str(pids[0]) not in health.text
        assert resp.status_code == 503 and str(pids[0]) not in resp.text
