"""Tests of ``kvstep proxy --backend``: one hop to replicas, and the routing policies.

The replicas are fake Starlette apps (``proxy_fakes``) on loopback ports; the proxy is
served the same way and called with a plain ``httpx.Client``.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("uvicorn")

import httpx
from proxy_fakes import SSE_BODY, Fake, Servers

from pipeline.errors import InvalidConfigError
from pipeline.proxy import ProxyOptions, add_proxy_flags, create_proxy_app, proxy_options

BODY = {"model": "m", "prompt": "hello", "max_tokens": 7}


class Replicas:
    """``count`` fake replicas behind the proxy with ``policy``."""

    def __init__(self, serve: Servers, count: int = 3, policy: str = "round-robin") -> None:
        self.fakes = [Fake(f"r{i}") for i in range(count)]
        self.urls = [serve(f.app).url for f in self.fakes]
        options = ProxyOptions(
            backend=tuple(self.urls),
            policy=policy,
            health_interval_s=30.0,
            connect_timeout_s=1.0,
            upstream_timeout_s=10.0,
        )
        self.proxy = serve(create_proxy_app(options))
        self.client = httpx.Client(base_url=self.proxy.url, timeout=10)
        serve.clients.append(self.client)

    def counts(self) -> list[int]:
        return [len(f.bodies) for f in self.fakes]

    def in_flight(self) -> dict[str, float]:
        """The proxy's ``kvstep_proxy_in_flight_requests`` gauge, by backend URL."""
        text = self.client.get("/metrics").text
        found = re.findall(
            r'kvstep_proxy_in_flight_requests\{.*?backend="([^"]+)".*?\} (\S+)', text
        )
        return {url: float(value) for url, value in found}


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


class TestOneHop:
    def test_the_body_reaches_one_replica_unchanged(self, serve: Servers) -> None:
        """No prefill hop, no kv_transfer_params added, n > 1 allowed; the client gets
        the replica's answer as it is, for completions and chat."""
        replicas = Replicas(serve)
        body = {**BODY, "n": 2}
        response = replicas.client.post("/v1/completions", json=body)
        assert response.status_code == 200
        [fake] = [f for f in replicas.fakes if f.bodies]
        assert fake.bodies == [body] and response.json()["id"] == fake.name
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert replicas.client.post("/v1/chat/completions", json=chat).status_code == 200
        assert sum(replicas.counts()) == 2

    def test_a_stream_is_relayed(self, serve: Servers) -> None:
        replicas = Replicas(serve, count=1)
        response = replicas.client.post("/v1/completions", json={**BODY, "stream": True})
        assert response.status_code == 200 and response.content == SSE_BODY

    def test_errors_pass_through_and_release_the_backend(self, serve: Servers) -> None:
        """A 400 reaches the client as it is, a 500 is a 502; neither stays in flight."""
        replicas = Replicas(serve, count=1)
        replicas.fakes[0].mode = "400"
        assert replicas.client.post("/v1/completions", json=BODY).status_code == 400
        replicas.fakes[0].mode = "500"
        assert replicas.client.post("/v1/completions", json=BODY).status_code == 502
        replicas.fakes[0].mode = "break"
        response = replicas.client.post("/v1/completions", json={**BODY, "stream": True})
        assert b"upstream_error" in response.content
        assert replicas.in_flight() == {replicas.urls[0]: 0.0}

    def test_a_dead_replica_is_skipped(self, serve: Servers) -> None:
        """A replica that refuses connections: the request is retried on another and
        the dead one leaves the rotation."""
        replicas = Replicas(serve)
        serve.started[0].stop()
        for _ in range(4):
            assert replicas.client.post("/v1/completions", json=BODY).status_code == 200
        assert replicas.counts()[0] == 0 and sum(replicas.counts()) == 4
        health = replicas.client.get("/health").json()
        assert health["pools"] == {"backend": {"healthy": 2, "total": 3}}


class TestPolicies:
    def test_round_robin_takes_each_replica_in_turn(self, serve: Servers) -> None:
        replicas = Replicas(serve)
        for _ in range(6):
            assert replicas.client.post("/v1/completions", json=BODY).status_code == 200
        assert replicas.counts() == [2, 2, 2]

    @pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
    def test_least_loaded_avoids_a_busy_replica(self, serve: Servers, policy: str) -> None:
        """While a stream is open on one replica, least-loaded sends every other request
        to the idle one (round-robin, the control, does not); once the stream ends the
        replica counts nothing in flight."""
        replicas = Replicas(serve, count=2, policy=policy)
        for fake in replicas.fakes:
            fake.mode = "slow"  # streams until the client leaves
        with replicas.client.stream("POST", "/v1/completions", json={**BODY, "stream": True}):
            _wait(lambda: sum(replicas.counts()) == 1)
            busy = replicas.counts().index(1)
            assert replicas.in_flight()[replicas.urls[busy]] == 1.0
            for _ in range(4):
                assert replicas.client.post("/v1/completions", json=BODY).status_code == 200
            sent_to_busy = replicas.counts()[busy] - 1
        assert sent_to_busy == (0 if policy == "least-loaded" else 2)
        _wait(lambda: replicas.fakes[busy].stream_closed.is_set())
        _wait(lambda: set(replicas.in_flight().values()) == {0.0})


class TestOptions:
    @pytest.mark.parametrize(
        ("fields", "name"),
        [
            ({}, "prefill"),
            ({"decode": ("http://d:1",)}, "prefill"),
            ({"backend": ("http://a:1",), "prefill": ("http://b:2",)}, "prefill"),
            ({"backend": ("http://a:1",), "decode": ("http://b:2",)}, "decode"),
            ({"backend": ("http://a:1",), "policy": "random"}, "policy"),
            ({"backend": ("ftp://a:1",)}, "backend"),
            ({"backend": ("http://a:1", "http://a:1")}, "backend"),
        ],
    )
    def test_one_mode_and_a_known_policy(self, fields: dict[str, Any], name: str) -> None:
        """Replicas or a prefill and a decode pool, never both or neither."""
        with pytest.raises(InvalidConfigError) as info:
            ProxyOptions(**fields)
        assert info.value.field == name

    def test_flags(self) -> None:
        parser = argparse.ArgumentParser()
        add_proxy_flags(parser)
        args = parser.parse_args(
            ["--backend", "http://a:1/", "http://b:2", "--policy", "least-loaded"]
        )
        options = proxy_options(args)
        assert options.backend == ("http://a:1", "http://b:2") and not options.disaggregated
        assert options.policy == "least-loaded" and options.prefill == options.decode == ()
        with pytest.raises(SystemExit):
            parser.parse_args(["--backend", "http://a:1", "--policy", "random"])
