"""Shared by the KV event tests: a small engine with events on ``ipc`` sockets, a tier's
scheduler half found inside ``multi``/``faulty``, a subscriber drained up to the
publisher's last batch, and one request run (optionally aborted) on an engine."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import anyio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from connectors.multi import MultiScheduler
from connectors.testing import FaultyConnector
from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.kv_events import (
    KVBlockIndex,
    KVEvent,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
)

DRAIN_LIMIT_S = 30.0  # a bound on a hang, never a timing assertion
BLOCK = 4
T = TypeVar("T")


def engine_examples(max_examples: int) -> settings:
    """Hypothesis settings of a test whose every example runs an engine: no deadline,
    and no shrinking (a failing example is reported as found)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow],
    )


def events_config(
    directory: str,
    connector: str | None = None,
    options: dict[str, Any] | None = None,
    **events: Any,
) -> EngineConfig:
    """A tiny engine (14 device blocks: prefixes are evicted and loaded back) with events
    on ``ipc`` sockets under ``directory`` (more ``KVEventsConfig`` fields in ``events``)."""
    kv = KVEventsConfig(
        endpoint=f"ipc://{directory}/events", replay_endpoint=f"ipc://{directory}/replay", **events
    )
    return EngineConfig(
        block_size=BLOCK,
        num_gpu_blocks=14,
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        connector=connector,
        connector_options=options or {},
        kv_events=kv,
    )


def tier_of(engine: AsyncEngine, kind: type[T]) -> T:
    """The engine's connector tier of type ``kind`` (alone, the first tier of multi, or
    inside faulty)."""
    connector: Any = engine.core.connector
    if isinstance(connector, MultiScheduler):
        connector = connector.tiers[0]
    if isinstance(connector, FaultyConnector.Scheduler):
        connector = connector.inner
    assert isinstance(connector, kind)
    return connector


def drain(sub: KVEventSubscriber, pub: ZmqEventPublisher, index: KVBlockIndex) -> list[KVEvent]:
    """Apply every batch ``pub`` has numbered so far, live or replayed, in order; return
    their events."""
    events: list[KVEvent] = []
    give_up = time.monotonic() + DRAIN_LIMIT_S
    while sub.next_seq < pub.next_seq:
        assert time.monotonic() < give_up, f"stuck at seq {sub.next_seq} of {pub.next_seq}"
        got = sub.poll(0.2)
        if not got:  # a slow joiner missed the tail: ask the replay socket
            got = sub.catch_up(5.0)
        for item in got:
            index.apply(item.batch)
            events.extend(item.batch.events)
    return events


async def run_request(
    engine: AsyncEngine, prompt: list[int], max_tokens: int, abort: int | None
) -> None:
    """Generate greedily; with ``abort``, leave the stream after ``abort + 1`` outputs."""
    stream = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    seen = 0
    try:
        async for _ in stream:
            seen += 1
            if abort is not None and seen > abort:
                break
    finally:
        await stream.aclose()


async def until_at_rest(engine: AsyncEngine, timeout_s: float = 15.0) -> None:
    """Wait (bounded) until ``engine.is_idle``: no step runs, none is needed."""
    with anyio.fail_after(timeout_s):
        while not engine.is_idle:
            await anyio.sleep(0.005)


#: Two shared prompt prefixes the random workloads draw from.
PREFIXES = ([7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 1, 3, 9, 9, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18])


def requests(max_tokens: int, abort_after: int) -> st.SearchStrategy[tuple]:
    """One request of a random workload: (prefix index, prefix tokens kept, own suffix,
    max_tokens, abort after this many outputs or None)."""
    return st.tuples(
        st.sampled_from(range(len(PREFIXES))),
        st.integers(0, 16),
        st.lists(st.integers(20, 40), min_size=1, max_size=6),
        st.integers(1, max_tokens),
        st.none() | st.integers(0, abort_after),
    )
