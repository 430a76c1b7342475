"""KV events of the offload tier: medium ``"CPU"``, stored once a save is committed, removed
when evicted or dropped; with the device tier's (``"GPU"``) in the same step batches."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_events_helpers import (
    BLOCK,
    PREFIXES,
    drain,
    engine_examples,
    events_config,
    requests,
    run_request,
    tier_of,
    until_at_rest,
)

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.multi import MultiScheduler
from connectors.offload import OffloadScheduler, SlotIndex
from connectors.testing import FaultyConnector, RecordingConnector
from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVBlockIndex,
    KVEvent,
    KVEventSink,
    KVEventSubscriber,
    external_block_hash,
)

FP = ModelFingerprint(architecture="Llama", weights_id="w", dtype="float32", block_size=BLOCK)
OFFLOAD = {"connector": "offload", "options": {"num_blocks": 6}}


def _digest(n: int) -> bytes:
    return n.to_bytes(32, "big")


def _engine_config(directory: str, connector: str = "offload", **options: Any) -> EngineConfig:
    return events_config(directory, connector, options or {"num_blocks": 6})


def _offload_of(engine: AsyncEngine) -> OffloadScheduler:
    return tier_of(engine, OffloadScheduler)


def _held(engine: AsyncEngine) -> dict[str, set[int]]:
    """What each tier really holds: the pool's cached hashes, the offload tier's keys."""
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    offload = _offload_of(engine).index
    return {
        MEDIUM_GPU: {external_block_hash(h) for h in pool.cached},
        MEDIUM_CPU: {external_block_hash(h) for _, h in offload.committed()},
    }


def _context(**options: Any) -> ConnectorContext:
    return ConnectorContext(
        role=KVConnectorRole.SCHEDULER, options=options, block_size=BLOCK, fingerprint=FP
    )


class Run(NamedTuple):
    """A finished run: its events, the index rebuilt from them, what the tiers hold."""

    events: list[KVEvent]
    index: KVBlockIndex
    held: dict[str, set[int]]


async def _run(config: EngineConfig, prompts: list[list[int]]) -> Run:
    """Run ``prompts`` one after the other (2 tokens each) and drain the stream."""
    assert config.kv_events is not None
    index = KVBlockIndex()
    with KVEventSubscriber(config.kv_events.endpoint, config.kv_events.replay_endpoint) as sub:
        async with AsyncEngine(config) as engine:
            for prompt in prompts:
                await run_request(engine, prompt, 2, None)
            events = drain(sub, engine.core.kv_events.publisher, index)
            return Run(events, index, _held(engine))


def _host_events(events: list[KVEvent]) -> list[KVEvent]:
    """The offload tier's events."""
    return [
        e for e in events if isinstance(e, BlockStored | BlockRemoved) and e.medium == MEDIUM_CPU
    ]


class TestSharedSinks:
    def test_tiers_share_one_list_in_order(self) -> None:
        """A sink made with for_medium appends to its parent's list: one take hands over
        both tiers' events, in the order they happened, and empties both."""
        device = KVEventSink(BLOCK, MEDIUM_GPU, include_token_ids=True)  # tokens asserted
        host = device.for_medium(MEDIUM_CPU)
        device.removed(_digest(1))
        host.removed(_digest(2))  # another medium: not merged into the GPU removal
        host.stored_hash(_digest(3))
        host.stored_hash(_digest(4))  # merged: same medium, hashes only
        device.stored([_digest(5)], None, [1, 2, 3, 4])
        host.stored_hash(_digest(6))  # not merged into an event with tokens
        h = external_block_hash
        assert device.take() == [
            BlockRemoved([h(_digest(1))], MEDIUM_GPU),
            BlockRemoved([h(_digest(2))], MEDIUM_CPU),
            BlockStored([h(_digest(3)), h(_digest(4))], None, [], BLOCK, None, MEDIUM_CPU),
            BlockStored([h(_digest(5))], None, [1, 2, 3, 4], BLOCK, None, MEDIUM_GPU),
            BlockStored([h(_digest(6))], None, [], BLOCK, None, MEDIUM_CPU),
        ]
        assert host.take() == [] and device.events is host.events

    def test_hash_format_is_inherited(self) -> None:
        """A derived sink writes hashes in its parent's format."""
        host = KVEventSink(BLOCK, MEDIUM_GPU, "bytes").for_medium(MEDIUM_CPU)
        host.stored_hash(_digest(9))
        assert host.take() == [BlockStored([_digest(9)], None, [], BLOCK, None, MEDIUM_CPU)]


class TestSlotIndexEvents:
    def _index(self, num_slots: int) -> tuple[SlotIndex, KVEventSink]:
        index = SlotIndex(num_slots)
        sink = KVEventSink(BLOCK, MEDIUM_CPU, "bytes")
        index.kv_events = sink
        return index, sink

    def test_only_committed_keys_are_announced(self) -> None:
        """reserve announces nothing, commit announces the hash, abort (a failed save)
        announces nothing; touching changes nothing."""
        index, sink = self._index(4)
        a, b = ("fp", _digest(1)), ("fp", _digest(2))
        index.reserve(a)
        index.reserve(b)
        assert sink.take() == []
        index.commit(a)
        index.abort(b)
        index.touch(a)
        assert sink.take() == [BlockStored([_digest(1)], None, [], BLOCK, None, MEDIUM_CPU)]

    def test_eviction_and_discard_remove(self) -> None:
        """An LRU eviction for a new save and a dropped (failed-load) key are removed,
        pinned or not; the index then holds exactly the keys the events say."""
        index, sink = self._index(2)
        keys = [("fp", _digest(i)) for i in range(3)]
        for key in keys[:2]:
            index.reserve(key)
            index.commit(key)
        slot = index.lookup(keys[1])
        assert slot is not None
        index.pin(slot)
        index.reserve(keys[2])  # evicts keys[0], the least recently used unpinned
        index.discard(keys[1])  # pinned: orphaned, but gone from the tier's keys now
        index.commit(keys[2])
        events = sink.take()
        assert events[-2:] == [
            BlockRemoved([_digest(0), _digest(1)], MEDIUM_CPU),
            BlockStored([_digest(2)], None, [], BLOCK, None, MEDIUM_CPU),
        ]
        rebuilt = KVBlockIndex()
        rebuilt.apply_events(events)
        assert rebuilt.hashes(MEDIUM_CPU) == {h for _, h in index.committed()}

    def test_no_sink_no_events(self) -> None:
        """Events off: the index has no sink and works as before."""
        index = SlotIndex(1)
        assert index.kv_events is None
        index.reserve(("fp", _digest(1)))
        index.commit(("fp", _digest(1)))
        assert index.committed() == [("fp", _digest(1))]


class TestHook:
    def test_offload_reports_as_cpu_into_the_shared_list(self) -> None:
        """The offload scheduler hands its index a CPU sink sharing the engine's list."""
        sink = KVEventSink(BLOCK, MEDIUM_GPU)
        scheduler = OffloadScheduler(_context(num_blocks=4))
        assert scheduler.index.kv_events is None
        scheduler.set_kv_event_sink(sink)
        tier = scheduler.index.kv_events
        assert tier is not None and tier.medium == MEDIUM_CPU and tier.events is sink.events

    def test_multi_and_faulty_forward_and_others_ignore_it(self) -> None:
        """multi gives the sink to every tier, faulty to its inner half; a connector
        that does not publish (recording) takes the call and does nothing."""
        sink = KVEventSink(BLOCK, MEDIUM_GPU)
        multi = MultiScheduler(_context(tiers=[OFFLOAD, {"connector": "recording"}]))
        faulty = FaultyConnector.Scheduler(
            _context(inner="offload", inner_options=OFFLOAD["options"])
        )
        for connector in (multi, faulty):
            connector.set_kv_event_sink(sink)
        first = multi.tiers[0]
        assert isinstance(first, OffloadScheduler) and first.index.kv_events is not None
        assert isinstance(faulty.inner, OffloadScheduler)
        assert faulty.inner.index.kv_events is not None
        RecordingConnector.Scheduler(_context()).set_kv_event_sink(sink)
        assert sink.take() == []


request_st = requests(max_tokens=5, abort_after=2)


class TestExactness:
    # No shrinking: every example runs an engine, and a failing one is reported as found.
    @engine_examples(3)
    @given(
        waves=st.lists(st.lists(request_st, min_size=1, max_size=4), min_size=2, max_size=3),
        async_load=st.booleans(),
    )
    def test_index_per_medium_equals_each_tier(self, waves, async_load) -> None:
        """Random waves of requests (device evictions, offload LRU evictions, aborts,
        loads from the tier): the index rebuilt from the stream equals, per medium, the
        pool's cached hashes (GPU) and the offload tier's committed keys (CPU)."""
        with tempfile.TemporaryDirectory() as directory:
            config = _engine_config(directory, num_blocks=6, async_load=async_load)
            anyio.run(self._check, config, waves)

    async def _check(self, config: EngineConfig, waves: list) -> None:
        assert config.kv_events is not None
        index = KVBlockIndex()
        with KVEventSubscriber(config.kv_events.endpoint, config.kv_events.replay_endpoint) as sub:
            async with AsyncEngine(config) as engine:
                pub = engine.core.kv_events.publisher
                for wave in waves:
                    async with anyio.create_task_group() as tg:
                        for which, keep, suffix, max_tokens, abort in wave:
                            prompt = PREFIXES[which][:keep] + suffix
                            tg.start_soon(run_request, engine, prompt, max_tokens, abort)
                    await until_at_rest(engine)
                    drain(sub, pub, index)
                    held = _held(engine)
                    assert index.by_medium.keys() <= {MEDIUM_GPU, MEDIUM_CPU}
                    assert index.hashes(MEDIUM_GPU) == held[MEDIUM_GPU]
                    assert index.hashes(MEDIUM_CPU) == held[MEDIUM_CPU]
                assert sub.gaps == [] and sub.rejected == 0

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("connector", "options"),
        [
            ("offload", {"num_blocks": 6}),
            ("multi", {"tiers": [OFFLOAD]}),
            ("faulty", {"inner": "offload", "inner_options": {"num_blocks": 6}, "faults": []}),
        ],
    )
    async def test_offload_tier_stores_and_evicts(self, tmp_path: Path, connector, options) -> None:
        """More prompt blocks than the tier has slots: it stores (hashes only, no tokens)
        and evicts, under medium CPU, alone or behind multi or faulty; the index still
        equals both tiers."""
        config = _engine_config(str(tmp_path), connector, **options)
        run = await _run(config, [[50 + i] * 13 for i in range(4)])  # 12 blocks, 6 slots
        host = _host_events(run.events)
        assert {type(e) for e in host} == {BlockStored, BlockRemoved}
        stored = [e for e in host if isinstance(e, BlockStored)]
        assert all(e.token_ids == [] and e.block_size == BLOCK for e in stored)
        assert len(run.held[MEDIUM_CPU]) == 6
        assert run.index.hashes(MEDIUM_CPU) == run.held[MEDIUM_CPU]
        assert run.index.hashes(MEDIUM_GPU) == run.held[MEDIUM_GPU]


class TestFailures:
    @pytest.mark.anyio
    async def test_failed_saves_are_never_announced(self, tmp_path: Path) -> None:
        """Every save reported failed (faulty wait_for_save): the tier holds nothing and
        no CPU event is published, though every step scheduled saves."""
        fault = {"call": "wait_for_save", "action": "corrupt", "times": None}
        options = {"inner": "offload", "inner_options": {"num_blocks": 6}, "faults": [fault]}
        config = _engine_config(str(tmp_path), "faulty", **options)
        run = await _run(config, [[50 + i] * 13 for i in range(3)])
        assert run.held[MEDIUM_CPU] == set() and _host_events(run.events) == []
        assert run.index.hashes(MEDIUM_GPU) == run.held[MEDIUM_GPU] != set()

    @pytest.mark.anyio
    async def test_a_slot_that_failed_to_load_is_removed(self, tmp_path: Path) -> None:
        """A prefix evicted from the device and loaded back from the tier fails to load
        (faulty load errors): the tier drops it, and says so with BlockRemoved (no LRU
        eviction here: the tier has room for everything)."""
        fault = {"call": "get_block_ids_with_load_errors", "action": "corrupt", "times": None}
        options = {"inner": "offload", "inner_options": {"num_blocks": 64}, "faults": [fault]}
        config = _engine_config(str(tmp_path), "faulty", **options)
        prefix = PREFIXES[0]
        prompts = [[*prefix, 30], *([60 + i] * 13 for i in range(4)), [*prefix, 31]]
        run = await _run(config, prompts)
        assert any(isinstance(e, BlockRemoved) for e in _host_events(run.events))
        assert run.index.hashes(MEDIUM_CPU) == run.held[MEDIUM_CPU]
        assert run.index.hashes(MEDIUM_GPU) == run.held[MEDIUM_GPU]


class TestEventsOff:
    def test_offload_tier_gets_no_sink(self) -> None:
        """Without kv_events neither the pool nor the offload index has a sink."""
        config = EngineConfig(
            block_size=BLOCK,
            num_gpu_blocks=14,
            max_model_len=48,
            connector="offload",
            connector_options={"num_blocks": 6},
        )
        with LLM(config) as llm:
            core = llm.engine.core
            assert core.kv_events is None
            assert core.scheduler.kv_cache_manager.block_pool.kv_events is None
            connector = core.connector
            assert isinstance(connector, OffloadScheduler)
            llm.generate([[60 + i] * 13 for i in range(3)], SamplingParams(max_tokens=2))
            assert connector.index.kv_events is None
            assert len(connector.index) == 6
