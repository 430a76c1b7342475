"""``StoreEvents``: the KV events of one store tier (``shared_storage``, ``redis``).

A store is shared across engines and restarts and this engine keeps no index of it, so
what it can publish is what it **knows**: the hashes whose values it saw land in the
store for every rank, or found there, and not yet seen gone. :class:`StoreEvents`
keeps that set (``announced``) and publishes its changes, each hash stored once and
removed once:

- **stored**: a save this engine made landed (the step's output came back and no rank
  reported its request's save failed), or a probe found the block for every rank (a
  value another engine or an earlier run wrote);
- **removed**: this engine removed the value (its own eviction), or saw it gone: a
  probe's first miss, or a load that failed and a new probe that misses it.

A store tier's set is existence, as the probe sees it, not validity: a value that is
there but corrupt stays announced (loading it fails and the block is recomputed).
Changes the engine neither makes nor observes are not reported until it observes them:
another engine's eviction, a Redis TTL expiry or ``maxmemory`` eviction, a server that
restarted empty (each shows up as a probe miss of the hash, when a request next asks
for it). Several engines sharing one store each publish what they saved and observed;
a router indexing them all sees the store's blocks under every engine that knows them.

The set is bounded (:data:`MAX_ANNOUNCED`): past it the oldest announced hash is
removed (a router forgets a block it may still find, never invents one).

Owned by one scheduler half; event-loop thread; never blocks; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.kv_events.sink import KVEventSink

__all__ = ["MAX_ANNOUNCED", "StoreEvents"]

MAX_ANNOUNCED = 1 << 20
"""Hashes one store tier keeps announced at most (about 100 MiB of set at the cap)."""


class StoreEvents:
    """The announced hashes of one store tier and the sink their changes go to.

    Args:
        sink: The tier's sink (its ``medium`` is the tier's).
        max_announced: The bound on ``announced``.

    Attributes:
        announced: The hashes announced stored and not removed since, oldest first.
    """

    __slots__ = ("announced", "max_announced", "sink")

    def __init__(self, sink: KVEventSink, max_announced: int = MAX_ANNOUNCED) -> None:
        self.sink = sink
        self.max_announced = max_announced
        self.announced: dict[bytes, None] = {}  # insertion order: the oldest first

    def stored(self, hashes: Iterable[bytes]) -> None:
        """The store holds ``hashes`` for every rank: announce the new ones (past
        ``max_announced``, the oldest announced one is removed first)."""
        announced, sink = self.announced, self.sink
        for block_hash in hashes:
            if block_hash not in announced:
                if len(announced) >= self.max_announced:
                    oldest = next(iter(announced))
                    del announced[oldest]
                    sink.removed(oldest)
                announced[block_hash] = None
                sink.stored_hash(block_hash)

    def removed(self, hashes: Iterable[bytes]) -> None:
        """The store no longer holds ``hashes`` (for some rank): remove the announced
        ones (others were never announced)."""
        announced, sink = self.announced, self.sink
        for block_hash in hashes:
            if block_hash in announced:
                del announced[block_hash]
                sink.removed(block_hash)

    def probed(self, hashes: Sequence[bytes], found: Sequence[bool]) -> None:
        """What a probe of ``hashes`` said: the leading run of ``found`` is stored, the
        first ``False`` after it a miss; entries past it, or past the end of a shorter
        ``found`` (a probe that could not ask), say nothing."""
        count = 0
        for here in found:
            if not here:
                break
            count += 1
        self.stored(hashes[:count])
        if count < len(found):
            self.removed(hashes[count : count + 1])

    def recheck(
        self, hashes: Iterable[bytes], probe: Callable[[tuple[bytes, ...]], Sequence[bool]]
    ) -> None:
        """Loads of ``hashes`` failed: probe each announced one again and remove those
        found missing (a corrupt value that is still there stays announced). Blocks as
        long as the probes."""
        for block_hash in dict.fromkeys(hashes):
            if block_hash in self.announced:
                self.probed((block_hash,), probe((block_hash,)))
