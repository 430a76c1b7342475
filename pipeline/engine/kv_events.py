"""The engine's KV event stream: the tiers' sinks, one batch per step, the publisher.

The block pool reports the device tier (medium ``"GPU"`` on every device, as vLLM's
block pool) into the engine's sink; the connector's scheduler half gets the same sink
through ``set_kv_event_sink`` and each of its tiers that publishes reports under its
own medium (``offload``: ``"CPU"``, as vLLM's CPU offloading connector;
``shared_storage``: ``"DISK"``; ``redis``: ``"REDIS"``) into the same
list, so a step's batch holds every tier's events in the order they happened. The
device tier's ``BlockStored`` carry token ids only with
``KVEventsConfig(include_token_ids=True)``.

:func:`start_kv_events` gives ``None`` when ``EngineConfig.kv_events`` is ``None``: then
neither the pool nor the connector has a sink, and the engine step pays one
``is not None`` test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast

from pipeline.config import EngineConfig
from pipeline.kv_events.events import MEDIUM_GPU
from pipeline.kv_events.publisher import ZmqEventPublisher
from pipeline.kv_events.sink import KVEventSink
from stages.scheduler.block_pool import BlockPool

if TYPE_CHECKING:
    from connectors.base import KVConnectorScheduler

__all__ = ["KVEventStream", "start_kv_events"]


class KVEventStream:
    """Publishes the events of the engine's sinks, one batch per :meth:`flush`.

    Args:
        sink: The sink the block pool reports into (the connector's tiers share its
            list).
        publisher: Where the batches go.
    """

    def __init__(self, sink: KVEventSink, publisher: ZmqEventPublisher) -> None:
        self.sink = sink
        self.publisher = publisher

    def flush(self) -> int | None:
        """Publish the events since the last flush as one batch (none when there are
        none, as vLLM); returns its sequence number, or ``None``."""
        events = self.sink.take()
        if not events:
            return None
        return self.publisher.publish(events)

    def close(self) -> None:
        """Publish what is left, then close the publisher; idempotent."""
        try:
            if not self.publisher.closed:
                self.flush()
        finally:
            self.publisher.close()


def start_kv_events(
    config: EngineConfig, pool: BlockPool, connector: KVConnectorScheduler | None = None
) -> KVEventStream | None:
    """Attach a sink to ``pool`` and ``connector`` and start the publisher, or ``None``
    when events are off (then neither is touched).

    Raises:
        InvalidConfigError: An endpoint cannot be bound or connected, or ``pyzmq`` is
            missing.
        Exception: Whatever the connector's ``set_kv_event_sink`` raised (before the
            publisher is started).
    """
    settings = config.kv_events
    if settings is None:
        return None
    fmt = cast(Literal["int", "bytes"], settings.hash_format)
    sink = KVEventSink(
        config.block_size, MEDIUM_GPU, fmt, include_token_ids=settings.include_token_ids
    )
    if connector is not None:
        connector.set_kv_event_sink(sink)
    publisher = ZmqEventPublisher(settings)
    pool.kv_events = sink
    return KVEventStream(sink, publisher)
