"""KV events of a real engine are exact: an index rebuilt from them equals the pool's cache."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_events_helpers import (
    BLOCK,
    DRAIN_LIMIT_S,
    PREFIXES,
    drain,
    engine_examples,
    events_config,
    requests,
    run_request,
)

from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.kv_events import (
    KVBlockIndex,
    KVEventSubscriber,
    external_block_hash,
    prompt_block_hashes,
)


def _config(directory: str, **events: object) -> EngineConfig:
    return events_config(directory, **events)


def _cached(engine: AsyncEngine) -> set[int]:
    return {
        external_block_hash(h) for h in engine.core.scheduler.kv_cache_manager.block_pool.cached
    }


request_st = requests(max_tokens=6, abort_after=3)


class TestExactness:
    # No shrinking: every example runs an engine, and a failing one is reported as found.
    @engine_examples(5)
    @given(waves=st.lists(st.lists(request_st, min_size=1, max_size=4), min_size=1, max_size=3))
    def test_index_from_events_equals_the_pools_cache(self, waves) -> None:
        """Random waves of requests (evictions, preemptions, aborts): the index rebuilt from
        the live stream, and a late subscriber's index rebuilt by replay from sequence 0,
        both equal the block pool's cached hashes at the end."""
        with tempfile.TemporaryDirectory() as directory:
            anyio.run(self._check, directory, waves)

    async def _check(self, directory: str, waves: list) -> None:
        config = _config(directory)
        assert config.kv_events is not None
        live = KVEventSubscriber(config.kv_events.endpoint, config.kv_events.replay_endpoint)
        index = KVBlockIndex()
        try:
            async with AsyncEngine(config) as engine:
                pub = engine.core.kv_events.publisher
                for wave in waves:
                    async with anyio.create_task_group() as tg:
                        for which, keep, suffix, max_tokens, abort in wave:
                            prompt = PREFIXES[which][:keep] + suffix
                            tg.start_soon(run_request, engine, prompt, max_tokens, abort)
                    drain(live, pub, index)
                expected = _cached(engine)
                assert index.by_medium.keys() <= {"GPU"}
                assert index.hashes("GPU") == expected
                assert live.gaps == [] and live.rejected == 0

                late = KVEventSubscriber(
                    config.kv_events.endpoint, config.kv_events.replay_endpoint
                )
                with late:
                    replayed = KVBlockIndex()
                    for item in late.catch_up(5.0):
                        replayed.apply(item.batch)
                    assert late.gaps == []
                    assert late.next_seq == pub.next_seq
                assert replayed.hashes("GPU") == expected
        finally:
            live.close()

    @pytest.mark.anyio
    async def test_evictions_and_aborts_are_published(self, tmp_path: Path) -> None:
        """A workload larger than the pool evicts (BlockRemoved) and an aborted request's
        blocks stay cached; the live index still equals the cache."""
        config = _config(str(tmp_path))
        assert config.kv_events is not None
        index = KVBlockIndex()
        with KVEventSubscriber(config.kv_events.endpoint, config.kv_events.replay_endpoint) as sub:
            async with AsyncEngine(config) as engine:
                pub = engine.core.kv_events.publisher
                await run_request(engine, PREFIXES[0] + [30], 2, 0)  # aborted after 1 output
                for i in range(5):
                    await run_request(engine, [40 + i] * 20, 2, None)
                events = drain(sub, pub, index)
                assert index.hashes("GPU") == _cached(engine)
        kinds = {type(e).__name__ for e in events}
        assert kinds == {"BlockStored", "BlockRemoved"}


class TestLateSubscriber:
    async def _workload(self, engine: AsyncEngine) -> None:
        for i in range(4):
            prompt = PREFIXES[i % 2] + [20 + i] * 5
            await run_request(engine, prompt, 3, None)

    @pytest.mark.anyio
    async def test_gap_beyond_the_buffer_is_reported(self, tmp_path: Path) -> None:
        """With a 2-batch replay buffer, a late joiner replaying from 0 gets the last two
        batches and is told exactly which sequence numbers are gone."""
        config = _config(str(tmp_path), buffer_steps=2)
        assert config.kv_events is not None
        async with AsyncEngine(config) as engine:
            await self._workload(engine)
            pub = engine.core.kv_events.publisher
            total = pub.next_seq
            assert total > 2
            with KVEventSubscriber(
                config.kv_events.endpoint, config.kv_events.replay_endpoint
            ) as late:
                # Until the publisher thread has sent the last batch, the replay lags.
                give_up = time.monotonic() + DRAIN_LIMIT_S
                while late.next_seq < total and time.monotonic() < give_up:
                    late.gaps.clear()
                    late.next_seq = 0
                    got = late.catch_up(5.0)
                assert [item.seq for item in got] == [total - 2, total - 1]
                assert late.gaps == [range(0, total - 2)]


class TestRouterHashes:
    def test_router_hashes_equal_the_engines_request_hashes(self, tmp_path: Path) -> None:
        """prompt_block_hashes(prompt) is what the replica's requests hash to, and what its
        BlockStored events carry, for a non-default hash_seed."""
        config = EngineConfig(
            block_size=BLOCK, num_gpu_blocks=32, max_model_len=64, hash_seed=12345
        )
        prompt = PREFIXES[0] + [21, 22, 23]
        with LLM(config) as llm:
            core = llm.engine.core
            captured: list[list[bytes]] = []
            original = core.scheduler.add_request

            def spy(request):  # type: ignore[no-untyped-def]
                original(request)
                captured.append(list(request.block_hashes))

            core.scheduler.add_request = spy  # type: ignore[method-assign]
            llm.generate([prompt], SamplingParams(max_tokens=1))
        engine_hashes = [external_block_hash(h) for h in captured[0]]
        assert len(engine_hashes) == len(prompt) // BLOCK
        assert prompt_block_hashes(prompt, BLOCK, hash_seed=12345) == engine_hashes
        assert prompt_block_hashes(prompt, BLOCK, hash_seed=0) != engine_hashes


class TestEventsOff:
    def test_off_by_default_creates_nothing_and_changes_no_output(self, tmp_path: Path) -> None:
        """Without kv_events the pool has no sink, no publisher thread runs, and greedy
        outputs equal those of an engine publishing events."""
        prompts = [PREFIXES[0] + [30, 31], PREFIXES[1] + [32], PREFIXES[0][:9]]
        params = SamplingParams(max_tokens=5, temperature=0.0)
        off = EngineConfig(block_size=BLOCK, num_gpu_blocks=14, max_model_len=48)
        assert off.kv_events is None
        with LLM(off) as llm:
            assert llm.engine.core.kv_events is None
            assert llm.engine.core.scheduler.kv_cache_manager.block_pool.kv_events is None
            names = [t.name for t in threading.enumerate()]
            assert "kvstep-kv-events" not in names
            plain = [o.token_ids for o in llm.generate(prompts, params)]
        with LLM(_config(str(tmp_path))) as llm:
            published = [o.token_ids for o in llm.generate(prompts, params)]
        assert published == plain
        assert "kvstep-kv-events" not in [t.name for t in threading.enumerate()]
