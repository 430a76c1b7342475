"""The redis connector's pure parts: options, metadata, keys, rate-limited logging."""

from __future__ import annotations

import pytest

pytest.importorskip("redis", reason="the redis package is not installed")

from connectors.redis_store import RateLimitedLog, RedisMetadata, RedisOptions, store_key
from connectors.redis_store.metadata import BlockTransfer
from connectors.registry import get_connector
from pipeline.errors import InvalidConfigError

URL = "redis://127.0.0.1:6379/0"


class TestRedisOptions:
    def test_defaults(self):
        """Only url is required; the rest have bounded defaults."""
        opts = RedisOptions.from_options({"url": URL})
        # The TTL default became a day (issue 10, finding 15): it was "never expire".
        assert opts.key_prefix == "kvstep:" and opts.ttl_s == 86400.0 and not opts.tls
        assert 0.05 <= opts.timeout_s <= 0.2 and opts.pool_size >= 1

    def test_rediss_implies_tls_and_tls_rewrites_the_scheme(self):
        """rediss:// turns TLS on; tls=True on a redis:// URL connects with rediss://."""
        assert RedisOptions.from_options({"url": "rediss://h:1/0"}).tls
        opts = RedisOptions.from_options({"url": "redis://h:1/0", "tls": True})
        assert opts.client_url == "rediss://h:1/0"

    @pytest.mark.parametrize(
        ("options", "named"),
        [
            ({}, "url"),
            ({"url": "http://h:1"}, "url"),
            ({"url": URL, "ttl_s": 0}, "ttl_s"),
            ({"url": URL, "ttl_s": -1.5}, "ttl_s"),
            ({"url": URL, "timeout_s": True}, "timeout_s"),
            ({"url": URL, "load_timeout_s": "5"}, "load_timeout_s"),
            ({"url": URL, "pool_size": 0}, "pool_size"),
            ({"url": URL, "tls": "yes"}, "tls"),
            ({"url": URL, "password": 5}, "password"),
            ({"url": URL, "key_prefix": None}, "key_prefix"),
            ({"url": URL, "num_blocks": 4}, "num_blocks"),
        ],
    )
    def test_bad_options_name_the_option(self, options, named):
        """A bad, missing or unknown option raises InvalidConfigError naming it."""
        with pytest.raises(InvalidConfigError, match=named):
            RedisOptions.from_options(options)


class TestRedisMetadata:
    def test_round_trips_through_bytes(self):
        """The metadata crosses processes as msgpack bytes, equal after decoding."""
        loads = [BlockTransfer("a", 3, b"\x01" * 32)]
        saves = [BlockTransfer("b", 4, b"\x02" * 32), BlockTransfer("b", 5, b"\x03" * 32)]
        meta = RedisMetadata.build(7, loads, saves)
        again = RedisMetadata.from_bytes(meta.to_bytes())
        assert again == meta and again.loads() == loads and again.saves() == saves


class TestKeys:
    def test_key_layout(self):
        """prefix + fingerprint + ':' + hash hex."""
        assert store_key("p:", "fp", b"\xab\xcd") == b"p:fp:abcd"

    def test_registered_as_redis(self):
        """The registry's built-in 'redis' is this connector."""
        from connectors.redis_store import RedisScheduler, RedisWorker

        spec = get_connector("redis")
        assert spec.scheduler_cls is RedisScheduler and spec.worker_cls is RedisWorker


class TestRateLimitedLog:
    def test_holds_back_repeats_within_the_interval(self, monkeypatch):
        """Per event, only the first of a burst is logged; the next one after the interval
        reports how many were held back."""
        logged: list[dict] = []
        from connectors.redis_store import store

        class Sink:
            def warning(self, event: str, **fields: object) -> None:
                logged.append({"event": event, **fields})

        monkeypatch.setattr(store, "log", Sink())
        clock = iter([0.0, 1.0, 1.5, 2.0, 10.0])
        monkeypatch.setattr(store.time, "monotonic", lambda: next(clock))
        limiter = RateLimitedLog(interval_s=5.0)
        for event in ("x", "x", "y", "x", "x"):
            limiter.warning(event)
        assert [(e["event"], e["suppressed"]) for e in logged] == [("x", 0), ("y", 0), ("x", 2)]
