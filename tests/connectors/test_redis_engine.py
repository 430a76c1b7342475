"""The redis connector in running engines against a real redis-server: KV shared across
engines, and outputs identical to a run without any connector through every fault
(server killed, slow, corrupt values)."""

from __future__ import annotations

import random
import threading
import uuid
from pathlib import Path

import anyio
import pytest
import structlog

from connectors.redis_store import RedisStore, RedisWorker
from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def workload() -> list[list[int]]:
    """Shared prefixes: full sharing, a longer tail, a 2-block partial hit, unrelated."""
    rng = random.Random(11)
    base = [rng.randrange(1, 256) for _ in range(48)]
    return [
        [*base, *[rng.randrange(1, 256) for _ in range(5)]],
        [*base, *[rng.randrange(1, 256) for _ in range(27)]],
        [*base[:32], *[rng.randrange(1, 256) for _ in range(12)]],
        [rng.randrange(1, 256) for _ in range(37)],
    ]


def full_blocks(prompt: list[int]) -> int:
    """Tokens a full hit loads: every full block but never the last token."""
    return (len(prompt) - 1) // BS * BS


def config(
    path: Path, url: str | None, prefix: str = "", options: dict | None = None, **overrides
) -> EngineConfig:
    """An engine without prefix caching (every hit comes from redis), or without any
    connector when ``url`` is None."""
    connector = {} if url is None else {"url": url, "key_prefix": prefix, **(options or {})}
    fields = dict(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=False,
        connector="redis" if url is not None else None,
        connector_options=connector,
    )
    return EngineConfig(**{**fields, **overrides})


def redis_warnings(logs: list[dict]) -> set[str]:
    return {e["event"] for e in logs if e["log_level"] == "warning" and "redis" in e["event"]}


def workers(llm: LLM) -> list[RedisWorker]:
    found = [w.connector.inner for w in llm.engine.core.workers]
    assert all(isinstance(w, RedisWorker) for w in found)
    return found


def tokens(outputs) -> list[tuple[int, ...]]:
    return [tuple(o.token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(llama_path) -> list[tuple[int, ...]]:
    """Greedy outputs of the workload without a connector."""
    with LLM(config(llama_path, None)) as llm:
        return tokens(llm.generate(workload(), PARAMS))


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own per test, so tests never see each other's blocks."""
    return f"test-{uuid.uuid4().hex[:8]}:"


class TestSharing:
    def test_second_engine_loads_every_full_block(self, llama_path, redis_url, prefix, reference):
        """Two engines share the server: both match the reference, the second loads
        each prompt's full blocks from the store."""
        prompts = workload()
        with LLM(config(llama_path, redis_url, prefix)) as first:
            assert tokens(first.generate(prompts, PARAMS)) == reference
            (worker,) = workers(first)
            assert worker.stats.saved_blocks > 0 and worker.stats.failed_saves == 0
        with LLM(config(llama_path, redis_url, prefix)) as second:
            outputs = second.generate(prompts, PARAMS)
            assert tokens(outputs) == reference
            assert [o.num_cached_tokens for o in outputs] == [full_blocks(p) for p in prompts]
            (worker,) = workers(second)
            assert worker.stats.load_errors == 0
            assert worker.stats.loaded_blocks * BS >= sum(map(full_blocks, prompts))

    def test_two_ranks_store_and_load_their_own_shards(
        self, llama_path, redis_url, prefix, reference
    ):
        """world_size=2: every rank writes its own key; the second engine hits fully."""
        prompts = workload()
        with LLM(config(llama_path, redis_url, prefix, world_size=2)) as first:
            assert tokens(first.generate(prompts, PARAMS)) == reference
            rank0, rank1 = workers(first)
            assert rank0.fingerprint_key != rank1.fingerprint_key
            assert rank0.stats == rank1.stats and rank0.stats.saved_blocks > 0
        with LLM(config(llama_path, redis_url, prefix, world_size=2)) as second:
            outputs = second.generate(prompts, PARAMS)
            assert tokens(outputs) == reference
            assert [o.num_cached_tokens for o in outputs] == [full_blocks(p) for p in prompts]

    def test_ttl_is_set_when_asked(self, llama_path, redis_server, redis_url, prefix):
        """With ttl_s every stored value expires; without it none does."""
        with LLM(config(llama_path, redis_url, prefix, {"ttl_s": 120})) as llm:
            llm.generate(workload()[:1], PARAMS)
        with redis_server.client() as client:
            keys = list(client.scan_iter(match=f"{prefix}*"))
            assert keys
            ttls = [client.pttl(k) for k in keys]
        assert all(0 < t <= 120_000 for t in ttls)

    def test_another_fingerprint_never_matches(self, tiny_checkpoints, redis_url, prefix):
        """Blocks a llama engine stored are never loaded by a mistral engine (another
        fingerprint), though the prompts are the same."""
        with LLM(config(tiny_checkpoints["llama"], redis_url, prefix)) as llm:
            llm.generate(workload(), PARAMS)
        with LLM(config(tiny_checkpoints["mistral"], redis_url, prefix)) as llm:
            outputs = llm.generate(workload(), PARAMS)
            assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0]
            assert workers(llm)[0].stats.loaded_blocks == 0


class TestFaults:
    def test_corrupt_values_are_load_errors(
        self, llama_path, redis_server, redis_url, prefix, reference
    ):
        """Every stored value overwritten with garbage: each load fails verification,
        is recomputed, and outputs stay identical."""
        prompts = workload()
        with LLM(config(llama_path, redis_url, prefix)) as llm:
            llm.generate(prompts, PARAMS)
        with redis_server.client() as client:
            keys = list(client.scan_iter(match=f"{prefix}*"))
            for n, key in enumerate(keys):
                value = client.get(key)
                garbage = b"garbage" if n % 2 else value[:-7] + b"corrupt"
                client.set(key, garbage)
        with LLM(config(llama_path, redis_url, prefix)) as llm:
            with structlog.testing.capture_logs() as logs:
                assert tokens(llm.generate(prompts, PARAMS)) == reference
            stats = workers(llm)[0].stats
            assert stats.load_errors > 0 and stats.loaded_blocks == 0
        assert "redis: bad value, load error" in redis_warnings(logs)

    def test_server_killed_between_runs(
        self, llama_path, redis_server, redis_url, prefix, reference
    ):
        """The server dies after the first run: the second run misses and its saves fail
        (logged, no exception); after a restart the engine stores and serves again."""
        prompts = workload()
        with LLM(config(llama_path, redis_url, prefix)) as llm:
            assert tokens(llm.generate(prompts, PARAMS)) == reference
            redis_server.kill()
            fresh = [[n, *range(1, 40)] for n in (201, 202)]  # new blocks: saves fail
            with structlog.testing.capture_logs() as logs:
                outputs = llm.generate([*prompts, *fresh], PARAMS)
            assert {"redis: lookup failed, treated as a miss", "redis: save failed"} <= (
                redis_warnings(logs)
            )
            assert tokens(outputs[:4]) == reference
            assert all(o.num_cached_tokens == 0 for o in outputs)
            assert workers(llm)[0].stats.failed_saves > 0
            redis_server.start()  # empty: persistence is off
            assert tokens(llm.generate(prompts, PARAMS)) == reference
            outputs = llm.generate(prompts, PARAMS)
            assert tokens(outputs) == reference
            assert [o.num_cached_tokens for o in outputs] == [full_blocks(p) for p in prompts]

    @pytest.mark.anyio
    async def test_server_killed_mid_run(
        self, llama_path, redis_server, redis_url, prefix, reference
    ):
        """The server is killed while requests are in flight and restarted: every
        request completes with the reference output and the engine keeps serving."""
        prompts = workload()
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(config(llama_path, redis_url, prefix)) as engine:
            results: dict[int, tuple[int, ...]] = {}
            kill = [True]  # the first run only

            async def run(n: int) -> None:
                async for out in engine.generate(prompts[n], params):
                    if n == 0 and len(out.token_ids) == 2 and kill[0]:
                        redis_server.kill()
                    if out.finished:
                        results[n] = tuple(out.token_ids)

            with structlog.testing.capture_logs() as logs:
                async with anyio.create_task_group() as tg:
                    for n in range(len(prompts)):
                        tg.start_soon(run, n)
            assert [results[n] for n in range(len(prompts))] == reference
            assert "redis: save failed" in redis_warnings(logs)
            redis_server.start()
            kill[0] = False
            results.clear()
            async with anyio.create_task_group() as tg:
                for n in range(len(prompts)):
                    tg.start_soon(run, n)
            assert [results[n] for n in range(len(prompts))] == reference

    def test_slow_server_past_the_load_deadline(
        self, llama_path, redis_server, redis_url, prefix, reference, monkeypatch
    ):
        """The server stalls (DEBUG SLEEP from a second connection) right when the
        loads are sent: they miss the load deadline, are recomputed, outputs identical."""
        prompts = workload()
        with LLM(config(llama_path, redis_url, prefix)) as llm:
            llm.generate(prompts, PARAMS)
        real_get_many = RedisStore.get_many
        stalls: list[threading.Thread] = []

        def stalled_get_many(self, keys):
            def sleep() -> None:
                with redis_server.client() as client:
                    client.execute_command("DEBUG", "SLEEP", "1.0")

            thread = threading.Thread(target=sleep)
            thread.start()
            stalls.append(thread)
            threading.Event().wait(0.1)  # the server is asleep before the GETs go out
            return real_get_many(self, keys)

        monkeypatch.setattr(RedisStore, "get_many", stalled_get_many)
        with LLM(config(llama_path, redis_url, prefix, {"load_timeout_s": 0.3})) as llm:
            with structlog.testing.capture_logs() as logs:
                assert tokens(llm.generate(prompts, PARAMS)) == reference
            stats = workers(llm)[0].stats
            assert stats.load_errors > 0
        assert "redis: load timed out, recomputing" in redis_warnings(logs)
        for thread in stalls:
            thread.join()
        assert stalls
