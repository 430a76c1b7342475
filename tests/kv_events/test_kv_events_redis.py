"""KV events of the redis tier: medium ``"REDIS"``, stored once a save landed, removed
when a probe finds a key gone; without a TTL an index rebuilt from the stream equals the
server's keys for the engine's fingerprint."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from kv_events_helpers import BLOCK, engine_examples, requests
from store_events_helpers import engine_config, run_waves, store_of, tier_events

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.multi import MultiScheduler
from connectors.redis_store import MEDIUM_REDIS, RedisScheduler
from connectors.shared_storage import MEDIUM_DISK, SharedStorageScheduler
from pipeline import AsyncEngine
from pipeline.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVEventSink,
    prompt_block_digests,
    prompt_block_hashes,
)
from tests.connectors.conftest import redis_server, redis_url  # the real server fixtures

__all__ = ["redis_server", "redis_url"]  # fixtures used by name

request_st = requests(max_tokens=5, abort_after=2)


def _options(url: str, **more: Any) -> dict[str, Any]:
    """A fresh key prefix per engine, no TTL (nothing expires behind the engine)."""
    return {"url": url, "key_prefix": f"ev-{uuid.uuid4().hex[:8]}:", "ttl_s": None, **more}


def _contents(engine: AsyncEngine) -> set[bytes]:
    """The hashes the server holds a key of, for every rank's fingerprint."""
    store = store_of(engine)
    assert isinstance(store, RedisScheduler)
    per_rank = []
    for key in store.fingerprint_keys:
        head = f"{store.options.key_prefix}{key}:".encode()
        found = store.store.client.scan_iter(match=head + b"*", count=1000)
        per_rank.append({bytes.fromhex(k[len(head) :].decode()) for k in found})
    return set.intersection(*per_rank)


class TestExactness:
    # No shrinking: every example runs an engine, and a failing one is reported as found.
    @engine_examples(3)
    @given(waves=st.lists(st.lists(request_st, min_size=1, max_size=4), min_size=2, max_size=3))
    def test_index_equals_the_servers_keys(self, redis_server, waves) -> None:
        """Random waves (device evictions, loads from the server, aborts), no TTL: after
        each wave the index rebuilt from the stream equals the pool's hashes (GPU) and
        the server's keys (REDIS); a late subscriber replaying from 0 agrees."""
        redis_server.ensure_running()  # a session fixture: hypothesis reruns the body
        with tempfile.TemporaryDirectory() as directory:
            config = engine_config(directory, "redis", _options(redis_server.url))
            run = run_waves(config, waves, MEDIUM_REDIS, _contents)
        for medium in (MEDIUM_GPU, MEDIUM_REDIS):
            assert run.replayed.hashes(medium) == run.live.hashes(medium) == run.held[medium]

    def test_hashes_are_the_device_tiers(self, redis_url, tmp_path: Path) -> None:
        """A prompt's REDIS hashes are the ones a router computes (and the GPU tier's)."""
        prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 1, 3, 9]  # 3 full blocks
        config = engine_config(str(tmp_path), "redis", _options(redis_url))
        run = run_waves(config, [[(0, 0, prompt, 1, None)]], MEDIUM_REDIS, _contents)
        expected = set(prompt_block_hashes(prompt, BLOCK))
        assert run.live.hashes(MEDIUM_REDIS) == expected <= run.live.hashes(MEDIUM_GPU)
        stored = [e for e in tier_events(run.events, MEDIUM_REDIS) if isinstance(e, BlockStored)]
        assert all(e.token_ids == [] and e.block_size == BLOCK for e in stored)


class TestObserved:
    def test_expired_keys_are_removed_when_a_probe_misses_them(
        self, redis_server, redis_url, tmp_path: Path
    ) -> None:
        """Keys gone behind the engine (as a TTL expiry would leave it) stay announced
        until a request for the prefix probes them: then BlockRemoved, and the recomputed
        blocks are stored again; the index equals the keys at every wave's end."""
        prompt = [9] * 13
        hashes = prompt_block_hashes(prompt, BLOCK)
        filler = [[(0, 0, [70 + i] * 13, 1, None)] for i in range(4)]  # evict the device
        waves = [[(0, 0, prompt, 1, None)], *filler, [(0, 0, prompt, 1, None)]]

        def expire(engine: AsyncEngine, n: int) -> None:
            if n == len(filler):
                store = store_of(engine)
                assert isinstance(store, RedisScheduler)
                head = f"{store.options.key_prefix}{store.fingerprint_keys[0]}:"
                keys = [f"{head}{d.hex()}" for d in prompt_block_digests(prompt, BLOCK)]
                with redis_server.client() as client:
                    assert client.delete(*keys) == len(keys)

        config = engine_config(str(tmp_path), "redis", _options(redis_url))
        run = run_waves(config, waves, MEDIUM_REDIS, _contents, expire)
        events = tier_events(run.events, MEDIUM_REDIS)
        first = [type(e) for e in events if hashes[0] in getattr(e, "block_hashes", ())]
        assert first == [BlockStored, BlockRemoved, BlockStored]
        assert set(hashes) <= run.live.hashes(MEDIUM_REDIS) == run.held[MEDIUM_REDIS]

    def test_a_dead_server_removes_nothing(self, redis_server, redis_url) -> None:
        """A lookup that fails (server down) is no answer: nothing announced is removed."""
        fp = ModelFingerprint(architecture="A", weights_id="w", dtype="float32", block_size=4)
        context = ConnectorContext(
            role=KVConnectorRole.SCHEDULER,
            options=_options(redis_url, timeout_s=0.2),
            block_size=4,
            fingerprint=fp,
        )
        scheduler = RedisScheduler(context)
        sink = KVEventSink(4, MEDIUM_GPU)
        scheduler.set_kv_event_sink(sink)
        assert scheduler.kv_events is not None
        scheduler.kv_events.stored([b"\x01" * 32])
        sink.take()
        redis_server.kill()
        try:
            assert list(scheduler.probe((b"\x01" * 32,))) == []
            scheduler.kv_events.probed((b"\x01" * 32,), scheduler.probe((b"\x01" * 32,)))
            assert sink.take() == [] and scheduler.kv_events.announced.keys() == {b"\x01" * 32}
        finally:
            redis_server.start()
            scheduler.store.close()


class TestHook:
    def test_each_store_tier_reports_under_its_medium(self, redis_url, tmp_path: Path) -> None:
        """multi gives the engine's sink to both store tiers: each derives its own medium
        (DISK, REDIS) on the shared list; without the call neither has event state."""
        fp = ModelFingerprint(architecture="A", weights_id="w", dtype="float32", block_size=4)
        tiers = [
            {"connector": "shared_storage", "options": {"path": str(tmp_path / "s")}},
            {"connector": "redis", "options": _options(redis_url)},
        ]
        context = ConnectorContext(
            role=KVConnectorRole.SCHEDULER, options={"tiers": tiers}, block_size=4, fingerprint=fp
        )
        multi = MultiScheduler(context)
        disk, redis = multi.tiers
        assert isinstance(disk, SharedStorageScheduler) and isinstance(redis, RedisScheduler)
        assert disk.kv_events is None and redis.kv_events is None
        sink = KVEventSink(4, MEDIUM_GPU)
        multi.set_kv_event_sink(sink)
        assert disk.kv_events is not None and redis.kv_events is not None
        assert disk.kv_events.sink.medium == MEDIUM_DISK
        assert redis.kv_events.sink.medium == MEDIUM_REDIS
        assert disk.kv_events.sink.events is sink.events is redis.kv_events.sink.events
        redis.store.close()
