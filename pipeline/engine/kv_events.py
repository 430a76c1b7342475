"""The engine's KV event stream: the block pool's sink, one batch per step, the publisher.

:func:`start_kv_events` gives ``None`` when ``EngineConfig.kv_events`` is ``None``: then
the pool has no sink and the engine step pays one ``is not None`` test.
"""

from __future__ import annotations

from typing import Literal, cast

import torch

from pipeline.config import EngineConfig
from pipeline.kv_events.events import MEDIUM_CPU, MEDIUM_GPU
from pipeline.kv_events.publisher import ZmqEventPublisher
from pipeline.kv_events.sink import KVEventSink
from stages.schedule.block_pool import BlockPool

__all__ = ["KVEventStream", "device_medium", "start_kv_events"]


def device_medium(device: str) -> str:
    """The ``medium`` of the device tier: ``"CPU"`` on a CPU engine, else ``"GPU"``."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return MEDIUM_CPU
    return MEDIUM_GPU


class KVEventStream:
    """Publishes the events of the pool's sink, one batch per :meth:`flush`.

    Args:
        sink: The sink the block pool reports into.
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


def start_kv_events(config: EngineConfig, pool: BlockPool) -> KVEventStream | None:
    """Attach a sink to ``pool`` and start the publisher, or ``None`` when events are off.

    Raises:
        InvalidConfigError: An endpoint cannot be bound or connected, or ``pyzmq`` is
            missing.
    """
    settings = config.kv_events
    if settings is None:
        return None
    fmt = cast(Literal["int", "bytes"], settings.hash_format)
    sink = KVEventSink(config.block_size, device_medium(config.device), fmt)
    publisher = ZmqEventPublisher(settings)
    pool.kv_events = sink
    return KVEventStream(sink, publisher)
