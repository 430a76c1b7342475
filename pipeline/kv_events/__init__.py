"""KV cache events: what a replica's caches hold, published for routers (vLLM's schema).

The block pool (medium ``"GPU"``) and the connector tiers (``offload``: ``"CPU"``,
``shared_storage``: ``"DISK"``, ``redis``: ``"REDIS"``; ``multi`` passes it on) report
into :class:`KVEventSink` s sharing one list; the engine publishes each step's events as
one :class:`KVEventBatch` through a :class:`ZmqEventPublisher` (PUB socket and replay
ROUTER socket); a router reads them with a :class:`KVEventSubscriber`, keeps a
:class:`KVBlockIndex` per replica, and hashes prompts with :func:`prompt_block_hashes`.
The schema and wire format are described in :mod:`pipeline.kv_events.events` and
:mod:`pipeline.kv_events.publisher`. ``pyzmq`` is needed only once a publisher or
subscriber is made.
"""

from pipeline.kv_events.config import DEFAULT_ENDPOINT, KVEventsConfig, kv_events_config
from pipeline.kv_events.events import (
    HASH_FORMATS,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REDIS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
    prompt_block_digests,
    prompt_block_hashes,
)
from pipeline.kv_events.index import KVBlockIndex
from pipeline.kv_events.publisher import (
    END_SEQ,
    MAX_REQUEST_BYTES,
    REPLAY_RCVHWM,
    REPLAYS_PER_WAKE,
    BatchQueue,
    ZmqEventPublisher,
)
from pipeline.kv_events.replay_limit import ReplayLimiter
from pipeline.kv_events.sink import KVEventSink
from pipeline.kv_events.subscriber import (
    MAX_MESSAGE_BYTES,
    MAX_REPLAY_BYTES,
    RCVHWM,
    KVEventSubscriber,
    ReplayResult,
    SequencedBatch,
)

__all__ = [
    "DEFAULT_ENDPOINT",
    "END_SEQ",
    "HASH_FORMATS",
    "MAX_MESSAGE_BYTES",
    "MAX_REPLAY_BYTES",
    "MAX_REQUEST_BYTES",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_REDIS",
    "RCVHWM",
    "REPLAYS_PER_WAKE",
    "REPLAY_RCVHWM",
    "AllBlocksCleared",
    "BatchQueue",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVBlockIndex",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventSink",
    "KVEventSubscriber",
    "KVEventsConfig",
    "ReplayLimiter",
    "ReplayResult",
    "SequencedBatch",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
    "kv_events_config",
    "prompt_block_digests",
    "prompt_block_hashes",
]
