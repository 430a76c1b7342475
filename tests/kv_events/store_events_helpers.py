"""Shared by the store tiers' KV event tests: engine configs, what a store really holds,
and a random workload run with a live subscriber and a late one that replays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import anyio
from kv_events_helpers import (
    PREFIXES,
    drain,
    events_config,
    run_request,
    tier_of,
    until_at_rest,
)

from connectors.store import StoreScheduler
from pipeline import AsyncEngine, EngineConfig
from pipeline.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVBlockIndex,
    KVEvent,
    KVEventSubscriber,
    external_block_hash,
)


def engine_config(directory: str, connector: str, options: dict[str, Any]) -> EngineConfig:
    """:func:`events_config` of ``connector`` (a store tier)."""
    return events_config(directory, connector, options)


def store_of(engine: AsyncEngine) -> StoreScheduler:
    """The store tier's scheduler half (alone, first tier of multi, or inside faulty)."""
    return tier_of(engine, StoreScheduler)


def device_hashes(engine: AsyncEngine) -> set[int]:
    """The hashes the device tier holds."""
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    return {external_block_hash(h) for h in pool.cached}


def tier_events(events: list[KVEvent], medium: str) -> list[KVEvent]:
    """The events of one medium."""
    return [e for e in events if isinstance(e, BlockStored | BlockRemoved) and e.medium == medium]


StoreContents = Callable[[AsyncEngine], set[bytes]]
"""What a store really holds for the engine's fingerprint (every rank), as digests."""


class Run(NamedTuple):
    """A finished run: its events, the live index, the late subscriber's replayed one,
    and what the tiers hold at the end (int hashes per medium)."""

    events: list[KVEvent]
    live: KVBlockIndex
    replayed: KVBlockIndex
    held: dict[str, set[int]]


Between = Callable[[AsyncEngine, int], None]
"""Called after wave ``n`` was checked, before the next one starts."""


def run_waves(
    config: EngineConfig,
    waves: list[list[tuple]],
    medium: str,
    contents: StoreContents,
    between: Between | None = None,
) -> Run:
    """Run each wave of requests concurrently, one wave after the other; after each, once
    the engine is at rest (a client that left mid-stream leaves its abort, and with async
    scheduling a planned-ahead step, to the engine), the live index must equal both
    tiers. At the end a late subscriber replays from 0."""
    return anyio.run(_run_waves, config, waves, medium, contents, between)


async def _run_waves(
    config: EngineConfig,
    waves: list[list[tuple]],
    medium: str,
    contents: StoreContents,
    between: Between | None,
) -> Run:
    assert config.kv_events is not None
    endpoint, replay = config.kv_events.endpoint, config.kv_events.replay_endpoint
    live, events = KVBlockIndex(), []
    with KVEventSubscriber(endpoint, replay) as sub:
        async with AsyncEngine(config) as engine:
            pub = engine.core.kv_events.publisher
            for n, wave in enumerate(waves):
                async with anyio.create_task_group() as tg:
                    for which, keep, suffix, max_tokens, abort in wave:
                        prompt = PREFIXES[which][:keep] + suffix
                        tg.start_soon(run_request, engine, prompt, max_tokens, abort)
                await until_at_rest(engine)
                events += drain(sub, pub, live)
                held = {
                    MEDIUM_GPU: device_hashes(engine),
                    medium: {external_block_hash(h) for h in contents(engine)},
                }
                assert live.by_medium.keys() <= held.keys()
                assert live.hashes(MEDIUM_GPU) == held[MEDIUM_GPU]
                assert live.hashes(medium) == held[medium]
                if between is not None:
                    between(engine, n)
            assert sub.gaps == [] and sub.rejected == 0
            replayed = KVBlockIndex()
            with KVEventSubscriber(endpoint, replay) as late:
                for item in late.catch_up(5.0):
                    replayed.apply(item.batch)
                assert late.gaps == [] and late.next_seq == pub.next_seq
            return Run(events, live, replayed, held)
