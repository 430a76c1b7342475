"""``RedisScheduler``: the scheduler half of the redis connector.

The store is shared across engines and restarts, so this half keeps no authoritative
index: :meth:`RedisScheduler.probe` asks the server (one pipelined ``EXISTS`` round trip
per request, bounded by ``timeout_s``). A block counts as stored only when the key of
**every** rank's fingerprint exists (with tensor parallelism each rank stores its own
shard), so a hit never leaves one rank without its KV. A server that is down or slow is
a miss, logged at most once per few seconds; nothing reaches the engine.

Saves are the blocks that become full in a step, minus those this half recently saw in
the store (a bounded, expiring cache that only saves bandwidth: a block missing after
all is a load error, and the scheduler recomputes it). The per-step flow is
:class:`StoreScheduler`'s.

**KV events**: medium ``"REDIS"`` (:data:`MEDIUM_REDIS`; what is reported:
:class:`~connectors.store.events.StoreEvents`). The engine never deletes a key, and
Redis tells no client when a key expires (``ttl_s``) or is evicted (``maxmemory``)
unless keyspace notifications are configured on the server, which kvstep does not
require: such a loss is reported only when this engine observes it, as a probe's miss
of the hash (a request asking for it) or a failed load whose key is then found missing.
Until then the hash stays announced (a router may send a request that then recomputes
it). With ``ttl_s=None`` and no ``maxmemory`` eviction, the events equal the keys this
engine wrote or found. A lookup that fails (server down) removes nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

import redis

from connectors.base import ConnectorContext
from connectors.redis_store.metadata import RedisMetadata
from connectors.redis_store.options import RedisOptions
from connectors.redis_store.store import RateLimitedLog, RedisStore, store_key
from connectors.store.metadata import StoreMetadata
from connectors.store.scheduler import StoreScheduler
from connectors.store.tracking import leading_run
from pipeline.kv_events.events import MEDIUM_REDIS

__all__ = ["MEDIUM_REDIS", "RedisScheduler"]


_KNOWN_CAPACITY = 1 << 16  # hashes remembered as stored
_KNOWN_HORIZON_S = 300.0  # how long a remembered hash is trusted (half the TTL if less)


class RedisScheduler(StoreScheduler):
    """Asks the store what it holds and plans each step's loads and saves.

    Every method runs on the event loop thread; only ``get_num_new_matched_tokens``
    does I/O (and, with KV events on, ``update_connector_output`` after a failed load),
    bounded by ``timeout_s``.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    name: ClassVar[str] = "redis"
    medium: ClassVar[str] = MEDIUM_REDIS
    metadata_type: ClassVar[type[StoreMetadata]] = RedisMetadata

    def __init__(self, context: ConnectorContext) -> None:
        options = RedisOptions.from_options(context.options)  # before the fingerprint
        super().__init__(context)
        self.options = options
        self.store = RedisStore(self.options, self.options.timeout_s)
        ttl = self.options.ttl_s
        self._horizon = _KNOWN_HORIZON_S if ttl is None else min(_KNOWN_HORIZON_S, ttl / 2)
        self._known: OrderedDict[bytes, float] = OrderedDict()
        self._warn = RateLimitedLog()

    # ------------------------------------------------------------------ the cache

    def _remember(self, block_hash: bytes) -> None:
        self._known[block_hash] = time.monotonic()
        self._known.move_to_end(block_hash)
        while len(self._known) > _KNOWN_CAPACITY:
            self._known.popitem(last=False)

    def _is_known(self, block_hash: bytes) -> bool:
        seen = self._known.get(block_hash)
        if seen is None:
            return False
        if time.monotonic() - seen > self._horizon:
            del self._known[block_hash]
            return False
        return True

    # ------------------------------------------------------------------ the hooks

    def probe(self, hashes: tuple[bytes, ...]) -> Sequence[bool]:
        """One pipelined ``EXISTS`` of every rank's key of ``hashes``; blocks for at most
        ``timeout_s``; a server error is no answer (an empty list: a miss that says
        nothing about the store), logged. Remembers the matched run as stored and
        forgets the hashes found missing."""
        prefix, fps = self.options.key_prefix, self.fingerprint_keys
        keys = [store_key(prefix, fp, h) for h in hashes for fp in fps]
        try:
            found = self.store.exists_many(keys)
        except redis.RedisError as exc:
            self._warn.warning("redis: lookup failed, treated as a miss", error=repr(exc))
            return []
        stored = [all(found[n * len(fps) : (n + 1) * len(fps)]) for n in range(len(hashes))]
        for block_hash, here in zip(hashes, stored, strict=True):
            if not here:  # expired, evicted, or the server restarted empty: save it again
                self._known.pop(block_hash, None)
        for block_hash in hashes[: leading_run(stored)]:
            self._remember(block_hash)
        return stored

    def wants_save(self, req_id: str, block_hash: bytes) -> bool:
        """Every block not known to be stored."""
        return not self._is_known(block_hash)

    def settle(self, landed: list[bytes], lost: list[bytes]) -> None:
        """Remember the step's landed hashes as stored; forget hashes whose load
        failed, so their recomputed blocks are written again."""
        for block_hash in landed:
            self._remember(block_hash)
        for block_hash in lost:
            self._known.pop(block_hash, None)
