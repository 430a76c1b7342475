"""RedisScheduler's lookups against a real redis-server: runs of stored blocks, every
rank required, fingerprints kept apart, and a dead or slow server is a miss."""

from __future__ import annotations

import socket
import threading
import uuid

import pytest

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.redis_store import RedisScheduler, store_key
from pipeline.block_hashes import hash_request_tokens
from pipeline.config import SamplingParams
from pipeline.request import Request

BS = 4


def fingerprint(dtype: str = "float32", tp_size: int = 1) -> ModelFingerprint:
    return ModelFingerprint(
        architecture="LlamaForCausalLM",
        weights_id="w",
        dtype=dtype,
        block_size=BS,
        tp_size=tp_size,
    )


def make(
    url: str, prefix: str, fp: ModelFingerprint | None = None, world_size: int = 1, **opts
) -> RedisScheduler:
    fp = fp or fingerprint(tp_size=world_size)
    context = ConnectorContext(
        role=KVConnectorRole.SCHEDULER,
        options={"url": url, "key_prefix": prefix, **opts},
        block_size=BS,
        fingerprint=fp,
        world_size=world_size,
    )
    return RedisScheduler(context)


def request(prompt: list[int]) -> Request:
    req = Request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    req.block_hashes = hash_request_tokens(prompt, BS)
    return req


@pytest.fixture
def prefix() -> str:
    return f"sched-{uuid.uuid4().hex[:8]}:"


def store(redis_server, prefix: str, fp_key: str, hashes) -> None:
    with redis_server.client() as client:
        for block_hash in hashes:
            client.set(store_key(prefix, fp_key, block_hash), b"x")


class TestRedisSchedulerLookup:
    def test_longest_stored_run_never_the_last_token(self, redis_server, redis_url, prefix):
        """Blocks 0, 1 and 3 stored: the match is blocks 0-1; a fully stored prompt
        still leaves its last token to compute."""
        sched = make(redis_url, prefix)
        req = request(list(range(1, 17)))  # 4 full blocks
        fp_key = sched.fingerprint_keys[0]
        store(redis_server, prefix, fp_key, [req.block_hashes[i] for i in (0, 1, 3)])
        assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 2 * BS
        store(redis_server, prefix, fp_key, [req.block_hashes[2]])
        assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 3 * BS
        assert sched.get_num_new_matched_tokens(req, BS).num_tokens == 2 * BS

    def test_every_rank_must_hold_the_block(self, redis_server, redis_url, prefix):
        """world_size=2: rank 0's key alone is a miss; both ranks' keys are a hit."""
        sched = make(redis_url, prefix, world_size=2)
        req = request(list(range(1, 10)))
        rank0, rank1 = sched.fingerprint_keys
        assert rank0 != rank1
        store(redis_server, prefix, rank0, req.block_hashes)
        assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 0
        store(redis_server, prefix, rank1, req.block_hashes)
        assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 2 * BS

    def test_another_fingerprint_never_matches(self, redis_server, redis_url, prefix):
        """Blocks stored under a float32 fingerprint are a miss for a bfloat16 one."""
        writer = make(redis_url, prefix)
        reader = make(redis_url, prefix, fp=fingerprint("bfloat16"))
        req = request(list(range(1, 10)))
        store(redis_server, prefix, writer.fingerprint_keys[0], req.block_hashes)
        assert writer.get_num_new_matched_tokens(req, 0).num_tokens == 2 * BS
        assert reader.get_num_new_matched_tokens(req, 0).num_tokens == 0

    def test_dead_server_is_a_miss(self, prefix):
        """Nothing listening: 0 tokens, no exception."""
        with socket.socket() as sock:  # a port nobody listens on once closed
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        sched = make(f"redis://127.0.0.1:{port}/0", prefix)
        assert sched.get_num_new_matched_tokens(request(list(range(1, 10))), 0).num_tokens == 0

    def test_slow_server_is_a_miss(self, redis_server, redis_url, prefix):
        """A server stalled past timeout_s: 0 tokens, no exception; a hit again after."""
        sched = make(redis_url, prefix, timeout_s=0.05)
        req = request(list(range(1, 10)))
        store(redis_server, prefix, sched.fingerprint_keys[0], req.block_hashes)
        started = threading.Event()

        def stall() -> None:
            with redis_server.client() as client:
                started.set()
                client.execute_command("DEBUG", "SLEEP", "0.5")

        thread = threading.Thread(target=stall)
        thread.start()
        started.wait()
        threading.Event().wait(0.05)
        try:
            assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 0
        finally:
            thread.join()
        assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 2 * BS
