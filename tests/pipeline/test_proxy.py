"""Tests of ``kvstep proxy``: the two-hop protocol against fake producers and consumers.

Every backend is a small Starlette app that records what it received, served by uvicorn
on a loopback port in a background thread; so is the proxy, which the tests call with a
plain ``httpx.Client``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("uvicorn")

import httpx
from proxy_fakes import SSE_BODY, SSE_CHUNKS, Fake, Servers
from server_process import ServerProcess, run_server

from pipeline.cli.main import main
from pipeline.proxy import ProxyOptions, create_proxy_app
from pipeline.server.options import ServerOptions


class Cluster:
    """Two producers, two consumers and the proxy in front of them."""

    def __init__(
        self,
        serve: Servers,
        *,
        interval: float = 0.1,
        cap: int = 1 << 20,
        backend_api_key: str | None = None,
        **kw: Any,
    ) -> None:
        self.producers = [Fake("p0"), Fake("p1")]
        self.consumers = [Fake("d0"), Fake("d1")]
        self.backends = {f: serve(f.app) for f in self.producers + self.consumers}
        proxy = ProxyOptions(
            prefill=tuple(self.backends[f].url for f in self.producers),
            decode=tuple(self.backends[f].url for f in self.consumers),
            health_interval_s=interval,
            health_timeout_s=1.0,
            connect_timeout_s=1.0,
            upstream_timeout_s=10.0,
            max_response_bytes=cap,
            backend_api_key=backend_api_key,
        )
        self.proxy = serve(create_proxy_app(proxy, ServerOptions(**kw)))
        self.client = httpx.Client(base_url=self.proxy.url, timeout=10)
        serve.clients.append(self.client)

    def post(
        self, body: dict[str, Any], path: str = "/v1/completions", **kw: Any
    ) -> httpx.Response:
        return self.client.post(path, json=body, **kw)

    def received(self, fakes: list[Fake]) -> list[dict[str, Any]]:
        return [body for fake in fakes for body in fake.bodies]


@pytest.fixture
def cluster(serve: Servers) -> Cluster:
    return Cluster(serve)


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


BODY = {"model": "m", "prompt": "hello", "max_tokens": 7}


class TestTwoHop:
    def test_producer_prefills_one_token_and_consumer_gets_its_params(self, cluster: Cluster):
        """The producer gets max_tokens 1, stream false and do_remote_decode; the consumer
        the original body plus the producer's kv_transfer_params; the client its answer."""
        response = cluster.post({**BODY, "stream_options": {"include_usage": True}})
        assert response.status_code == 200
        [prefill] = cluster.received(cluster.producers)
        assert prefill["max_tokens"] == 1 and prefill["stream"] is False
        assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
        assert "stream_options" not in prefill and prefill["prompt"] == "hello"
        [decode] = cluster.received(cluster.consumers)
        producer = next(f for f in cluster.producers if f.bodies)
        assert decode["max_tokens"] == 7 and "stream" not in decode
        params = {"do_remote_prefill": True, "remote_engine_id": producer.name}
        assert decode["kv_transfer_params"] == params
        consumer = next(f for f in cluster.consumers if f.bodies)
        assert response.json()["id"] == consumer.name

    def test_chat_caps_max_completion_tokens_instead(self, cluster: Cluster):
        """A chat body's max_completion_tokens is 1 at the producer (no max_tokens beside
        it, which kvstep refuses), as sent at the consumer."""
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        body["max_completion_tokens"] = 9
        assert cluster.post(body, "/v1/chat/completions").status_code == 200
        [prefill] = cluster.received(cluster.producers)
        assert prefill["max_completion_tokens"] == 1 and "max_tokens" not in prefill
        [decode] = cluster.received(cluster.consumers)
        assert decode["max_completion_tokens"] == 9 and "max_tokens" not in decode

    def test_streaming_passes_the_consumers_bytes_unchanged(self, cluster: Cluster):
        """A streamed answer reaches the client byte for byte, as an event stream."""
        with cluster.client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert b"".join(r.iter_raw()) == SSE_BODY
        [decode] = cluster.received(cluster.consumers)
        assert decode["stream"] is True and decode["max_tokens"] == 7

    def test_headers_are_propagated(self, serve: Servers):
        """X-Request-Id reaches both hops; the proxy's own key is checked and never
        passed on: the backends get the proxy's backend key instead."""
        cluster = Cluster(serve, api_key="sekrit", backend_api_key="backend-key")
        assert cluster.post(BODY).status_code == 401
        headers = {"Authorization": "Bearer sekrit", "X-Request-Id": "abc-1"}
        assert cluster.post(BODY, headers=headers).status_code == 200
        for fake in cluster.producers + cluster.consumers:
            for seen in fake.headers:
                assert seen["authorization"] == "Bearer backend-key"
                assert seen["x-request-id"] == "abc-1"


class TestRouting:
    def test_round_robin_over_producers_and_consumers(self, cluster: Cluster):
        """Four requests: two on each producer and two on each consumer."""
        for _ in range(4):
            assert cluster.post(BODY).status_code == 200
        assert [len(f.bodies) for f in cluster.producers] == [2, 2]
        assert [len(f.bodies) for f in cluster.consumers] == [2, 2]

    def test_dead_producer_is_skipped_and_the_request_retried(self, serve: Servers):
        """A producer that refuses connections: the request is retried on the other, and
        the dead one leaves the rotation (before any health poll)."""
        cluster = Cluster(serve, interval=600.0)
        cluster.backends[cluster.producers[0]].stop()
        for _ in range(3):
            assert cluster.post(BODY).status_code == 200
        assert len(cluster.producers[1].bodies) == 3
        health = cluster.client.get("/health").json()
        assert health["pools"]["prefill"] == {"healthy": 1, "total": 2}
        metrics = cluster.client.get("/metrics").text
        assert 'kvstep_proxy_upstream_errors_total{backend="' in metrics
        assert 'kind="connect",pool="prefill"} 1.0' in metrics
        assert 'kvstep_proxy_healthy_backends{pool="prefill"} 1.0' in metrics

    def test_health_poll_takes_backends_out_and_puts_them_back(self, cluster: Cluster):
        """A producer failing /health leaves the rotation and comes back once healthy."""
        cluster.producers[0].healthy = False
        _wait(lambda: cluster.client.get("/health").json()["pools"]["prefill"]["healthy"] == 1)
        for _ in range(2):
            assert cluster.post(BODY).status_code == 200
        assert len(cluster.producers[0].bodies) == 0
        cluster.producers[1].healthy = False
        _wait(lambda: cluster.client.get("/health").status_code == 503)
        assert "prefill" in cluster.client.get("/health").json()["error"]["message"]
        cluster.producers[0].healthy = cluster.producers[1].healthy = True
        _wait(lambda: cluster.client.get("/health").status_code == 200)

    def test_all_producers_dead_is_a_503(self, cluster: Cluster):
        """With no producer reachable the client gets an OpenAI-shaped 503."""
        for fake in cluster.producers:
            cluster.backends[fake].stop()
        response = cluster.post(BODY)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_backend"
        assert cluster.received(cluster.consumers) == []


class TestErrors:
    @pytest.mark.parametrize("hop", ["producers", "consumers"])
    def test_upstream_400_passes_through(self, cluster: Cluster, hop: str):
        """A backend's 400 reaches the client with its status and error body."""
        for fake in getattr(cluster, hop):
            fake.mode = "400"
        response = cluster.post(BODY)
        assert response.status_code == 400
        assert response.json()["error"]["message"].endswith("says no")

    @pytest.mark.parametrize("hop", ["producers", "consumers"])
    def test_upstream_500_is_a_502(self, cluster: Cluster, hop: str):
        """A backend's 500 becomes an OpenAI-shaped 502, without the backend's text."""
        for fake in getattr(cluster, hop):
            fake.mode = "500"
        response = cluster.post(BODY)
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "upstream_error" and "says no" not in error["message"]

    def test_oversized_producer_answer_is_a_502(self, serve: Servers):
        """The producer's answer is read under max_response_bytes; past it, a 502."""
        cluster = Cluster(serve, cap=2048)
        for fake in cluster.producers:
            fake.mode = "huge"
        response = cluster.post(BODY)
        assert response.status_code == 502
        assert cluster.received(cluster.consumers) == []

    def test_broken_stream_ends_with_an_error_event(self, cluster: Cluster):
        """A consumer dying mid-stream: the chunks sent so far, then an SSE error event."""
        for fake in cluster.consumers:
            fake.mode = "break"
        response = cluster.post({**BODY, "stream": True})
        assert response.status_code == 200
        assert response.content.startswith(b"".join(SSE_CHUNKS))
        last = response.content[len(b"".join(SSE_CHUNKS)) :]
        assert last.startswith(b"data: ") and last.endswith(b"\n\n")
        assert json.loads(last[6:])["error"]["type"] == "upstream_error"

    def test_client_disconnect_closes_the_upstream_stream(self, cluster: Cluster):
        """A client leaving mid-stream ends the consumer's stream too."""
        for fake in cluster.consumers:
            fake.mode = "slow"
        with cluster.client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            assert next(r.iter_raw()).startswith(SSE_CHUNKS[0])
        consumer = next(f for f in cluster.consumers if f.bodies)
        assert consumer.stream_closed.wait(5)

    @pytest.mark.parametrize(
        ("body", "param"), [({**BODY, "n": 2}, "n"), ([1, 2], None), ("text", None)]
    )
    def test_refused_at_the_door(self, cluster: Cluster, body: Any, param: str | None):
        """n > 1 and a body that is no JSON object are 400s; no backend sees them."""
        response = cluster.post(body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param
        assert cluster.received(cluster.producers + cluster.consumers) == []

    def test_body_over_the_cap_is_a_413(self, serve: Servers):
        """The proxy's body cap applies before anything is forwarded."""
        cluster = Cluster(serve, max_body_bytes=1024)
        response = cluster.post({**BODY, "prompt": "x" * 2000})
        assert response.status_code == 413
        assert cluster.received(cluster.producers) == []


@pytest.fixture(scope="module")
def kvstep_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """A real ``kvstep serve`` producer and consumer (builtin:tiny, no KV connector)."""
    logs = tmp_path_factory.mktemp("proxy-e2e")
    with (
        run_server("builtin:tiny", logs / "prefill.log", ["--max-model-len", "256"]) as p,
        run_server("builtin:tiny", logs / "decode.log", ["--max-model-len", "256"]) as d,
    ):
        yield [p, d]


@pytest.mark.slow
class TestAgainstKvstepServe:
    def test_answers_as_the_consumer_would(self, serve: Servers, kvstep_pair: list[Any]):
        """Through the proxy, kvstep servers accept both hops and the client gets the
        consumer's greedy answer, streamed or not; chat with max_completion_tokens too."""
        producer, consumer = kvstep_pair
        app = create_proxy_app(ProxyOptions(prefill=(producer.url,), decode=(consumer.url,)))
        proxy = serve(app)
        client = httpx.Client(base_url=proxy.url, timeout=60)
        serve.clients.append(client)
        body = {"model": "builtin:tiny", "prompt": "hello world", "max_tokens": 5}
        body |= {"temperature": 0.0, "ignore_eos": True}
        direct = httpx.post(f"{consumer.url}/v1/completions", json=body, timeout=60).json()
        proxied = client.post("/v1/completions", json=body)
        assert proxied.status_code == 200, proxied.text
        assert proxied.json()["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        chat = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}]}
        reply = client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 3})
        assert reply.status_code == 200, reply.text


class TestCli:
    def test_help_lists_the_flags(self, capsys: pytest.CaptureFixture[str]):
        """``kvstep proxy --help`` names every flag, each with its default."""
        with pytest.raises(SystemExit):
            main(["proxy", "--help"])
        out = capsys.readouterr().out
        for flag in ("--prefill", "--decode", "--host", "--port", "--health-interval",
                     "--api-key", "--max-body-bytes", "--upstream-timeout"):  # fmt: skip
            assert flag in out
        assert out.count("(default:") + out.count("; default:") >= 14

    def test_proxy_command_serves_with_its_flags(self, monkeypatch: pytest.MonkeyPatch):
        """``kvstep proxy`` builds ProxyOptions and ServerOptions from its flags."""
        import pipeline.proxy

        calls: list[tuple[Any, ...]] = []
        monkeypatch.setattr(pipeline.proxy, "serve_proxy", lambda *a, **kw: calls.append(a))
        monkeypatch.delenv("KVSTEP_API_KEY", raising=False)
        argv = ["proxy", "--prefill", "http://p:1", "http://p:2/", "--decode", "http://d:1"]
        argv += ["--port", "9001", "--health-interval", "0.5", "--max-body-bytes", "4096"]
        assert main(argv) == 0
        [(proxy, host, port, options)] = calls
        assert proxy.prefill == ("http://p:1", "http://p:2") and proxy.decode == ("http://d:1",)
        assert proxy.health_interval_s == 0.5 and (host, port) == ("127.0.0.1", 9001)
        assert options.max_body_bytes == 4096 and options.api_key is None

    def test_bad_url_is_a_config_error(self, capsys: pytest.CaptureFixture[str]):
        """A backend that is no http URL: exit status 2 and a message naming the field."""
        assert main(["proxy", "--prefill", "ftp://x", "--decode", "http://d:1"]) == 2
        assert "prefill" in capsys.readouterr().err
