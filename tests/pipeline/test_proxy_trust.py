"""The proxy as the trust boundary between clients and engines: it owns the transfer
parameters and the backends' credentials, and passes the request id through.

Backends are the recording fakes of ``proxy_fakes`` (and one real ``kvstep serve`` with
an API key); the proxy is served on loopback and called as a client would.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")

import httpx
from proxy_fakes import Fake, Servers
from server_process import run_server

from pipeline.cli.main import build_parser
from pipeline.errors import InvalidConfigError
from pipeline.proxy import ProxyOptions, create_proxy_app, proxy_options
from pipeline.server.options import ServerOptions

SSRF = {
    "do_remote_prefill": True,
    "remote_engine_id": "victim",
    "remote_host": "169.254.169.254",
    "remote_port": 80,
    "remote_block_ids": [1, 2, 3],
}
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "kv_transfer_params": SSRF}
KEY = "backend-secret-7f3a"


def _proxy(serve: Servers, options: ProxyOptions, **server: Any) -> httpx.Client:
    served = serve(create_proxy_app(options, ServerOptions(**server)))
    client = httpx.Client(base_url=served.url, timeout=10)
    serve.clients.append(client)
    return client


def _replicas(serve: Servers, count: int = 2, **kw: Any) -> tuple[list[Fake], httpx.Client]:
    fakes = [Fake(f"r{i}") for i in range(count)]
    urls = tuple(serve(f.app).url for f in fakes)
    options = ProxyOptions(backend=urls, health_interval_s=0.2, **kw)
    return fakes, _proxy(serve, options)


def _seen(fakes: list[Fake]) -> list[dict[str, Any]]:
    return [body for fake in fakes for body in fake.bodies]


def _headers(fakes: list[Fake]) -> list[dict[str, str]]:
    return [headers for fake in fakes for headers in fake.headers]


class TestTransferParams:
    def test_replicas_never_see_a_clients_transfer_params(self, serve: Servers) -> None:
        """In front of replicas, a client's kv_transfer_params (naming 169.254.169.254)
        are removed, completions and chats, streamed or not; the drop is counted."""
        fakes, client = _replicas(serve)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for path, body in (
            ("/v1/completions", BODY),
            ("/v1/completions", {**BODY, "stream": True}),
            ("/v1/chat/completions", {**chat, "kv_transfer_params": SSRF}),
        ):
            assert client.post(path, json=body).status_code == 200
        seen = _seen(fakes)
        assert len(seen) == 3 and all("kv_transfer_params" not in body for body in seen)
        metrics = client.get("/metrics").text
        assert "kvstep_proxy_client_transfer_params_dropped_total 3.0" in metrics

    @pytest.mark.parametrize("producer_mode", ["ok", "bare"])
    def test_pd_pools_use_only_the_producers_params(
        self, serve: Servers, producer_mode: str
    ) -> None:
        """In front of P/D pools the producer gets do_remote_decode only, and the
        consumer only what the producer answered: nothing at all when it answered none."""
        producer, consumer = Fake("p0"), Fake("d0")
        producer.mode = producer_mode
        options = ProxyOptions(
            prefill=(serve(producer.app).url,),
            decode=(serve(consumer.app).url,),
            health_interval_s=0.2,
        )
        client = _proxy(serve, options)
        assert client.post("/v1/completions", json=BODY).status_code == 200
        [prefill] = producer.bodies
        assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
        [decode] = consumer.bodies
        if producer_mode == "bare":
            assert "kv_transfer_params" not in decode
        else:
            assert decode["kv_transfer_params"] == {
                "do_remote_prefill": True,
                "remote_engine_id": "p0",
            }
        assert "169.254.169.254" not in str(producer.bodies + consumer.bodies)


class TestCredentials:
    def test_a_clients_authorization_never_reaches_a_backend(self, serve: Servers) -> None:
        """Without a backend key the backends get no Authorization at all, whatever the
        client sent; X-Request-Id passes through as sent."""
        fakes, client = _replicas(serve)
        headers = {"Authorization": "Bearer X", "X-Request-Id": "trace-42"}
        assert client.post("/v1/completions", json=BODY, headers=headers).status_code == 200
        [seen] = _headers(fakes)
        assert "authorization" not in seen
        assert seen["x-request-id"] == "trace-42"

    def test_the_backend_key_goes_to_requests_and_health_polls(self, serve: Servers) -> None:
        """--backend-api-key is the bearer key of every request and /health poll to a
        backend; the client's own key (the proxy's) is not."""
        fakes, client = _replicas(serve, backend_api_key=KEY)
        for _ in range(2):
            response = client.post(
                "/v1/completions", json=BODY, headers={"Authorization": "Bearer X"}
            )
            assert response.status_code == 200
        assert [h["authorization"] for h in _headers(fakes)] == [f"Bearer {KEY}"] * 2
        _wait_for(lambda: len(fakes[0].health_auth) >= 2)
        assert set(fakes[0].health_auth) == {f"Bearer {KEY}"}

    def test_a_real_server_with_a_key_answers_through_the_proxy(
        self, serve: Servers, tmp_path: Path
    ) -> None:
        """A real kvstep serve --api-key behind the proxy: a client without the key gets
        its answer (the proxy sends the backend key), a client's wrong key changes
        nothing, and the key never shows in the proxy's answer."""
        env = {"KVSTEP_API_KEY": KEY}
        with run_server("builtin:tiny", tmp_path / "serve.log", env=env) as server:
            options = ProxyOptions(backend=(server.url,), backend_api_key=KEY)
            client = _proxy(serve, options)
            body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
            direct = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert direct.status_code == 401  # the key is really required
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = client.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                assert KEY not in response.text

    def test_the_key_comes_from_the_environment_and_never_shows(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """$KVSTEP_BACKEND_API_KEY sets the key (so it stays out of ps); the flag wins;
        neither repr nor a refused value shows it."""
        parser = build_parser()
        monkeypatch.setenv("KVSTEP_BACKEND_API_KEY", KEY)
        args = parser.parse_args(["proxy", "--backend", "http://127.0.0.1:1"])
        options = proxy_options(args)
        assert options.backend_api_key == KEY
        assert KEY not in repr(options)
        args = parser.parse_args(["proxy", "--backend", "http://h:1", "--backend-api-key", "k2"])
        assert proxy_options(args).backend_api_key == "k2"
        with pytest.raises(InvalidConfigError) as info:
            ProxyOptions(backend=("http://h:1",), backend_api_key=f"{KEY} x")
        assert KEY not in str(info.value)

    def test_the_key_never_appears_in_logs(
        self, serve: Servers, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A backend that fails (connection refused, a 500) is logged without the key."""
        fakes, client = _replicas(serve, count=1, backend_api_key=KEY)
        fakes[0].mode = "500"
        with caplog.at_level(logging.DEBUG, logger="kvstep"):
            assert client.post("/v1/completions", json=BODY).status_code == 502
        assert "upstream_failed" in caplog.text
        assert KEY not in caplog.text


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
