"""The ``redis`` KV connector: KV blocks in a Redis/Valkey server shared across engines.

Registered as ``"redis"`` (needs the ``redis`` package: ``pip install kvstep[redis]``)::

    EngineConfig(connector="redis", connector_options={"url": "redis://127.0.0.1:6379/0"})

One framed value per block (``connectors.framing``) under
``key_prefix + fingerprint key + ":" + block hash hex``, pipelined lookups, reads and
writes, a TTL (default: a day; ``ttl_s=None`` for none). A server that is down or slow costs hits
(misses, load errors that are recomputed, failed saves), never a request or the engine.
The password comes from ``password_env``/``password_file`` and is never shown; with
``hmac_key_env`` every value is signed. Options: see :class:`RedisOptions`. KV events:
medium ``"REDIS"`` (:data:`MEDIUM_REDIS`; :mod:`connectors.redis_store.scheduler`).
"""

from connectors.redis_store.loader import RedisLoadJob
from connectors.redis_store.metadata import BlockTransfer, RedisMetadata
from connectors.redis_store.options import REDIS_OPTIONS, RedisOptions
from connectors.redis_store.scheduler import MEDIUM_REDIS, RedisScheduler
from connectors.redis_store.store import RateLimitedLog, RedisStore, store_key
from connectors.redis_store.worker import RedisWorker, RedisWorkerStats
from connectors.registry import register_connector

__all__ = [
    "MEDIUM_REDIS",
    "REDIS_OPTIONS",
    "BlockTransfer",
    "RateLimitedLog",
    "RedisLoadJob",
    "RedisMetadata",
    "RedisOptions",
    "RedisScheduler",
    "RedisStore",
    "RedisWorker",
    "RedisWorkerStats",
    "store_key",
]

register_connector("redis", RedisScheduler, RedisWorker)
