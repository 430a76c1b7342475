"""The drain on SIGTERM (``--shutdown-timeout``): real ``kvstep serve`` and ``kvstep proxy``
processes, real signals, streams in flight.

While draining, the listener stays open: a new request gets 503 ``server_draining`` with
``Retry-After``, ``/health`` 503 ``draining``; the streams in flight finish, or end with
``finish_reason: "abort"`` at the timeout; the process exits with status 0, within the
timeout and a few seconds.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")

import anyio
import httpx
from asgi_client import client_for
from proxy_fakes import Fake, Servers
from server_process import ServerProcess, free_port, launch, run_server

from pipeline import EngineConfig
from pipeline.errors import InvalidConfigError
from pipeline.server import ServerOptions, create_app

PROMPT = [1, 2, 3, 4, 5]
EXIT_SLACK_S = 5.0  # the acceptance bound: exit within the timeout + 5 s
LONG = 3000  # tokens: far more than any timeout here lets builtin:tiny generate


class Streams:
    """``n`` streaming completions, each in a thread: what each got and how it ended."""

    def __init__(self, url: str, n: int, body: dict[str, Any]) -> None:
        self.url = url
        self.started = threading.Barrier(n + 1)
        self.results: dict[int, dict[str, Any]] = {}
        self.threads = [threading.Thread(target=self._one, args=(i, body)) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _one(self, i: int, body: dict[str, Any]) -> None:
        got: dict[str, Any] = {"tokens": 0, "finish_reason": None, "done": False, "error": None}
        self.results[i] = got
        first = True
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                got["status"] = r.status_code
                for line in r.iter_lines():
                    if first:
                        first = False
                        self.started.wait(30)
                    if line == "data: [DONE]":
                        got["done"] = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        got["tokens"] += len(choice.get("token_ids") or [])
                        got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]
        except Exception as exc:  # a cut stream: the test reads it from the results
            got["error"] = repr(exc)
        finally:
            got["ended"] = time.monotonic()
            if first:
                self.started.abort()

    def wait_started(self) -> None:
        """Return once every stream has its first event (so all are in flight)."""
        self.started.wait(60)

    def join(self) -> dict[int, dict[str, Any]]:
        for thread in self.threads:
            thread.join(60)
        return self.results


def _stream_body(max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }


def _terminate(server: ServerProcess) -> float:
    """SIGTERM now; the time it was sent."""
    server.process.send_signal(signal.SIGTERM)
    return time.monotonic()


def _exit_after(server: ServerProcess, sent: float, limit_s: float) -> float:
    """Wait (bounded) for the process to exit; its status must be 0. Seconds since ``sent``."""
    rc = server.process.wait(timeout=limit_s + 30)
    took = time.monotonic() - sent
    assert rc == 0, f"exit status {rc}: {server.log_text()[-3000:]}"
    return took


def _assert_refused_while_draining(url: str) -> None:
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "draining"
    late = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
    assert late.status_code == 503, late.text
    assert late.headers["retry-after"] == "1"
    assert late.headers["connection"] == "close"
    assert late.json()["error"]["code"] == "server_draining"


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Any]:
    """``start(timeout_s, *flags)`` runs ``kvstep serve --model builtin:tiny`` with that
    ``--shutdown-timeout``; each is stopped at teardown if a test left it running."""

    def start(timeout_s: float, *flags: str) -> ServerProcess:
        extra = ["--shutdown-timeout", str(timeout_s), *flags]
        log = tmp_path / f"serve-{len(started)}.log"
        started.append(run_server("builtin:tiny", log, extra))
        return started[-1].__enter__()

    started: list[Any] = []
    yield start
    for context in started:
        context.__exit__(None, None, None)


class TestServeDrain:
    def test_streams_in_flight_finish_and_new_requests_get_503(self, serve_process: Any) -> None:
        """SIGTERM with 8 streams in flight: /health says draining, a new request gets 503
        with Retry-After on the open listener, all 8 finish normally (``length``, every
        token, ``[DONE]``), and the process exits with status 0 within the timeout."""
        timeout_s, max_tokens = 30.0, 400
        server = serve_process(timeout_s)
        streams = Streams(server.url, 8, _stream_body(max_tokens))
        streams.wait_started()
        sent = _terminate(server)
        time.sleep(0.3)  # the server's tick (0.1 s) starts the drain
        _assert_refused_while_draining(server.url)
        results = streams.join()
        took = _exit_after(server, sent, timeout_s)
        assert took < timeout_s, took
        assert all(r["ended"] > sent for r in results.values())  # in flight at the signal
        for r in results.values():
            assert (r["finish_reason"], r["tokens"], r["done"]) == ("length", max_tokens, True), r
        log = server.log_text()
        assert "drained" in log and "timed_out=False" in log, log[-2000:]
        assert "shutdown complete" in log

    def test_work_past_the_timeout_ends_with_abort(self, serve_process: Any) -> None:
        """With a timeout shorter than the work, the 8 streams end with ``abort`` (and
        ``[DONE]``) and the process still exits with status 0 within timeout + 5 s."""
        timeout_s = 1.0
        server = serve_process(timeout_s)
        streams = Streams(server.url, 8, _stream_body(LONG))
        streams.wait_started()
        sent = _terminate(server)
        results = streams.join()
        took = _exit_after(server, sent, timeout_s)
        print(f"exit {took:.2f} s after SIGTERM (--shutdown-timeout {timeout_s})")
        assert took < timeout_s + EXIT_SLACK_S, took
        for r in results.values():
            assert (r["status"], r["finish_reason"], r["done"]) == (200, "abort", True), r
            assert r["error"] is None and 0 < r["tokens"] < LONG
            assert r["ended"] - sent >= timeout_s - 0.2  # not before the timeout
        log = server.log_text()
        assert "timed_out=True aborted=8 cut=0" in log, log[-2000:]

    def test_a_second_signal_aborts_at_once(self, serve_process: Any) -> None:
        """A second SIGTERM during a long drain aborts what is in flight now."""
        server = serve_process(120.0)
        streams = Streams(server.url, 2, _stream_body(LONG))
        streams.wait_started()
        sent = _terminate(server)
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        results = streams.join()
        took = _exit_after(server, sent, 120.0)
        assert took < 0.5 + EXIT_SLACK_S, took
        assert [(r["finish_reason"], r["done"]) for r in results.values()] == [("abort", True)] * 2

    def test_kv_held_for_a_consumer_is_drained(self, serve_process: Any) -> None:
        """A producer holding a prefill's KV for a consumer that never reads it keeps
        draining (``/health``: draining, no request left) until the lease frees it, then
        exits (status 0) before the timeout."""
        pytest.importorskip("nixl_cu12")
        pytest.importorskip("zmq")
        options = json.dumps({"port": free_port(), "lease_s": 3})
        server = serve_process(60.0, "--kv-role", "producer", "--connector-options", options)
        body = {"prompt": list(range(1, 65)), "max_tokens": 1, "temperature": 0.0}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["kv_transfer_params"]["remote_block_ids"]  # held for a consumer
        sent = _terminate(server)
        time.sleep(0.5)
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert (health["status"], health["requests"], health["in_flight"]) == ("draining", 0, 0)
        took = _exit_after(server, sent, 60.0)
        assert 1.0 < took < 3 + EXIT_SLACK_S, took  # waited for the lease, not the timeout
        assert "timed_out=False" in server.log_text()


class TestProxyDrain:
    @pytest.fixture
    def backend(self, serve: Servers) -> Iterator[tuple[Fake, str]]:
        fake = Fake("replica")
        yield fake, serve(fake.app).url

    def _proxy(self, backend_url: str, tmp_path: Path, timeout_s: float) -> Any:
        args = ["--backend", backend_url, "--health-interval", "0.2"]
        return launch("proxy", [*args, "--shutdown-timeout", str(timeout_s)], tmp_path / "p.log")

    def test_proxied_streams_finish_and_new_requests_get_503(
        self, backend: tuple[Fake, str], tmp_path: Path
    ) -> None:
        """SIGTERM with proxied streams in flight: /health says draining, a new request
        gets 503 with Retry-After, the streams finish whole, the proxy exits with 0."""
        fake, url = backend
        fake.mode = "paced"
        with self._proxy(url, tmp_path, 30.0) as proxy:
            proxy.wait_healthy(time.monotonic() + 60)
            streams = Streams(proxy.url, 3, {"prompt": PROMPT, "stream": True})
            streams.wait_started()
            sent = _terminate(proxy)
            time.sleep(0.3)
            _assert_refused_while_draining(proxy.url)
            results = streams.join()
            took = _exit_after(proxy, sent, 30.0)
        assert took < 30.0, took
        assert all(r["done"] and r["error"] is None for r in results.values()), results

    def test_proxied_streams_past_the_timeout_are_cut(
        self, backend: tuple[Fake, str], tmp_path: Path
    ) -> None:
        """An endless proxied stream is cut at the timeout (no ``[DONE]``; the backend
        sees its client go) and the proxy exits with 0 within timeout + 5 s."""
        fake, url = backend
        fake.mode = "slow"
        timeout_s = 1.0
        with self._proxy(url, tmp_path, timeout_s) as proxy:
            proxy.wait_healthy(time.monotonic() + 60)
            streams = Streams(proxy.url, 1, {"prompt": PROMPT, "stream": True})
            streams.wait_started()
            sent = _terminate(proxy)
            [result] = streams.join().values()
            took = _exit_after(proxy, sent, timeout_s)
        assert took < timeout_s + EXIT_SLACK_S, took
        assert not result["done"], result
        assert fake.stream_closed.wait(10)
        assert "timed_out=True aborted=0 cut=1" in proxy.log_text()


class TestDrainInProcess:
    @pytest.mark.anyio
    async def test_drain_aborts_refuses_and_leaks_nothing(self) -> None:
        """In process: a request running past the timeout ends ``abort``; meanwhile a
        new one gets 503 and /health and /metrics say draining; the engine holds nothing
        after the drain (leak report all zero)."""
        app = create_app(
            EngineConfig(model="builtin:tiny"), options=ServerOptions(shutdown_timeout_s=0.5)
        )
        state = app.state.kvstep
        answers: dict[str, httpx.Response] = {}
        async with client_for(app) as client:

            async def long() -> None:
                body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
                answers["long"] = await client.post("/v1/completions", json=body)

            async with anyio.create_task_group() as tg:
                tg.start_soon(long)
                with anyio.fail_after(30):
                    while state.drain.in_flight == 0 or state.engine.num_steps < 3:
                        await anyio.sleep(0.01)
                tg.start_soon(state.drain.run)
                await anyio.sleep(0.1)
                late = await client.post("/v1/completions", json={"prompt": PROMPT})
                health = await client.get("/health")
                metrics = (await client.get("/metrics")).text
            leaks = state.engine.leak_report()
        assert answers["long"].json()["choices"][0]["finish_reason"] == "abort"
        assert (late.status_code, late.headers["retry-after"]) == (503, "1")
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        assert "kvstep_server_draining 1.0" in metrics
        assert "kvstep_server_drain_refused_total 1.0" in metrics
        assert state.drain.result.timed_out and state.drain.result.aborted == 1
        assert {k: v for k, v in leaks.items() if k != "cached_blocks" and v} == {}


class TestShutdownTimeoutOption:
    def test_zero_is_allowed_and_default_is_bounded(self) -> None:
        assert ServerOptions(shutdown_timeout_s=0).shutdown_timeout_s == 0
        assert ServerOptions().shutdown_timeout_s == 25.0

    @pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "5"])
    def test_a_bad_timeout_is_refused_naming_it(self, bad: object) -> None:
        with pytest.raises(InvalidConfigError, match="shutdown_timeout_s"):
            ServerOptions(shutdown_timeout_s=bad)  # type: ignore[arg-type]
