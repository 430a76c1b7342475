"""What KV events cost a scheduler step: off (the default), collected, and published.

One deterministic workload (shared prefixes, unique suffixes, a pool small enough to
evict) is driven through ``Scheduler.schedule`` + ``update_from_output`` with a fake
model, in rounds that alternate the variants:

* ``off``: ``EngineConfig.kv_events=None`` (the pool has no sink);
* ``collected``: a sink on the pool, its events taken once per step (the events are made);
* ``published``: also one ``KVEventBatch`` per step handed to a ``ZmqEventPublisher``
  (the engine thread's part; encoding and sending run on the publisher's thread).

Reported: the median (and best) µs per scheduler step of each variant over the rounds,
and what ``collected`` / ``published`` add to ``off`` (medians).
"""

from __future__ import annotations

import statistics
import tempfile
from time import perf_counter_ns
from typing import Any

from pipeline.artifacts import FanInOutput
from pipeline.config import SamplingParams
from pipeline.engine.kv_events import KVEventStream
from pipeline.kv_events import KVEventsConfig, KVEventSink, ZmqEventPublisher
from pipeline.request import Request
from stages.scheduler import Scheduler, SchedulerSettings

VARIANTS = ("off", "collected", "published")
_PREFIXES = [[p * 100 + i for i in range(32)] for p in range(6)]


def _scheduler() -> Scheduler:
    settings = SchedulerSettings(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128
    )
    return Scheduler(settings, num_blocks=48)


def _run(steps: int, stream: Any, sink: KVEventSink | None) -> tuple[float, int]:
    """µs per step over ``steps`` scheduler steps, and the events made."""
    scheduler = _scheduler()
    if sink is not None:
        scheduler.kv_cache_manager.block_pool.kv_events = sink
    params = SamplingParams(max_tokens=8)
    made = 0
    next_id = 0
    start = perf_counter_ns()
    for _ in range(steps):
        while scheduler.num_unfinished_requests() < 8:
            prompt = _PREFIXES[next_id % len(_PREFIXES)] + [7000 + next_id] * 8
            scheduler.add_request(Request(f"r{next_id}", prompt, params))
            next_id += 1
        so = scheduler.schedule()
        sampled = {item.req_id: 1 + item.num_output_tokens for item in so.requests if item.sample}
        scheduler.update_from_output(so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled))
        if stream is not None:
            made += len(stream.sink.events)
            stream.flush()
        elif sink is not None:
            made += len(sink.take())
    return (perf_counter_ns() - start) / 1000 / steps, made


def measure_kv_events(steps: int, rounds: int = 9) -> dict[str, Any]:
    """Median µs per scheduler step for each variant (rounds alternate the variants)."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    events = 0
    with tempfile.TemporaryDirectory() as directory:
        config = KVEventsConfig(
            endpoint=f"ipc://{directory}/events", replay_endpoint=f"ipc://{directory}/replay"
        )
        publisher = ZmqEventPublisher(config)
        try:
            for _ in range(rounds):
                times["off"].append(_run(steps, None, None)[0])
                sink = KVEventSink(4, "GPU")
                times["collected"].append(_run(steps, None, sink)[0])
                sink = KVEventSink(4, "GPU")
                stream = KVEventStream(sink, publisher)
                us, events = _run(steps, stream, sink)
                times["published"].append(us)
        finally:
            publisher.close()
    medians = {v: statistics.median(times[v]) for v in VARIANTS}
    best = {v: min(times[v]) for v in VARIANTS}  # least disturbed by other load
    return {
        "min_us_per_step": best,
        "steps": steps,
        "rounds": rounds,
        "events_per_step": events / steps,
        "median_us_per_step": medians,
        "collected_added_us": medians["collected"] - medians["off"],
        "published_added_us": medians["published"] - medians["off"],
    }


def print_kv_events(row: dict[str, Any]) -> None:
    m = row["median_us_per_step"]
    print(
        f"\nKV events per scheduler step ({row['steps']} steps x {row['rounds']} rounds, "
        f"{row['events_per_step']:.1f} events/step): off {m['off']:.1f} µs, "
        f"collected {m['collected']:.1f} µs (+{row['collected_added_us']:.1f}), "
        f"published {m['published']:.1f} µs (+{row['published_added_us']:.1f}); "
        f"best rounds: {', '.join(f'{v} {b:.1f}' for v, b in row['min_us_per_step'].items())} µs"
    )
