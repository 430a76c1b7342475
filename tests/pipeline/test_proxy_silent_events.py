"""A kv-aware backend that sends no KV events is said: one warning, a metric, ``/health``.

Unit tests of the rule (``EventWatch``, on a fake clock), and the proxy in front of a
replica whose ``/health`` advertises a publisher that never publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("zmq")

import httpx
from proxy_fakes import Servers
from test_proxy_kv_aware import BS, SEED, Replica, stored

from pipeline.proxy import ProxyOptions, create_proxy_app
from pipeline.proxy.event_watch import EventWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


class TestRule:
    def test_silent_only_after_an_expecting_request_and_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Idle, or served only full hits: never silent. N seconds after a request that
        should have stored blocks, with no event since: silent, one warning however
        many checks and requests follow; an event ends it."""
        clock = Clock()
        watch = EventWatch(["a", "b"], 30.0, clock)
        clock.now += 1000
        watch.routed("b", expects_store=False)  # a full hit stores nothing
        assert watch.check() == [] and watch.silent_backends() == []
        watch.routed("a", expects_store=True)
        clock.now += 29
        assert watch.check() == []
        clock.now += 2
        with caplog.at_level(logging.INFO, logger="kvstep"):
            assert watch.check() == ["a"]
            for _ in range(5):
                watch.routed("a", expects_store=True)
                clock.now += 10
                assert watch.check() == []
            assert watch.silent("a") and not watch.silent("b")
            assert watch.last_event_age("a") == pytest.approx(1081)
            watch.heard("a")
        warnings = [r for r in caplog.records if "kv_events_silent" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "kv_events_resumed" in caplog.text
        assert not watch.silent("a") and watch.last_event_age("a") == 0

    def test_an_event_after_the_request_keeps_it_quiet(self) -> None:
        """A request that should store blocks, then an event: not silent later."""
        clock = Clock()
        watch = EventWatch(["a"], 5.0, clock)
        watch.routed("a", expects_store=True)
        clock.now += 1
        watch.heard("a")
        clock.now += 60
        assert watch.check() == [] and not watch.silent("a")


class TestProxy:
    def test_a_replica_that_never_publishes_is_reported(
        self, serve: Servers, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Requests routed to a replica whose advertised publisher stays silent: after
        --kv-events-silent-after the metric is 1 for it (0 for the one that publishes),
        /health counts it, and the log has one kv_events_silent warning."""
        talking, mute = Replica("talking"), Replica("mute")
        urls = [serve(r.app).url for r in (talking, mute)]
        try:
            options = ProxyOptions(
                backend=tuple(urls),
                policy="kv-aware",
                block_size=BS,
                hash_seed=SEED,
                health_interval_s=0.2,
                events_silent_s=0.5,
            )
            proxy = serve(create_proxy_app(options))
            client = httpx.Client(base_url=proxy.url, timeout=10)
            serve.clients.append(client)
            with caplog.at_level(logging.INFO, logger="kvstep"):
                for i in range(6):  # round robin over both: each gets new prompts
                    prompt = [200 + i] * 9
                    body = {"prompt": prompt, "max_tokens": 1}
                    assert client.post("/v1/completions", json=body).status_code == 200
                    talking.publisher.publish([stored(prompt)])
                    time.sleep(0.1)

                def silent_metric(url: str) -> str:
                    for line in client.get("/metrics").text.splitlines():
                        if line.startswith(f'kvstep_proxy_backend_events_silent{{backend="{url}"'):
                            return line.rsplit(" ", 1)[1]
                    return "absent"

                _wait(lambda: silent_metric(urls[1]) == "1.0")
                time.sleep(1.0)  # more checks: still one warning
                assert silent_metric(urls[0]) == "0.0"
                health = client.get("/health").json()
                assert health["pools"]["backend"]["kv_events_silent"] == 1
                assert "kvstep_proxy_backend_last_event_age_seconds" in client.get("/metrics").text
            warnings = [r for r in caplog.records if "kv_events_silent" in r.getMessage()]
            assert len(warnings) == 1 and urls[1] in warnings[0].getMessage()
        finally:
            talking.publisher.close()
            mute.publisher.close()
