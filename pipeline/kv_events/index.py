"""``KVBlockIndex``: which block hashes one replica holds, per medium, rebuilt from its
events (what a router keeps per replica; the exactness tests compare it with the pool)."""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["KVBlockIndex"]


class KVBlockIndex:
    """The cached hashes of one replica, by medium, as its events say.

    Apply every batch in sequence order; ``BlockRemoved`` of a hash the index does not
    hold is ignored (a subscriber that joined late), and ``AllBlocksCleared`` empties every
    medium. Not thread-safe.
    """

    def __init__(self) -> None:
        self.by_medium: dict[str | None, set[ExternalBlockHash]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a batch's events in order."""
        self.apply_events(batch.events)

    def apply_events(self, events: Iterable[KVCacheEvent]) -> None:
        """Apply events in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self.by_medium.setdefault(event.medium, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.by_medium.get(event.medium)
                if held is not None:
                    held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.by_medium.clear()

    def hashes(self, medium: str | None) -> set[ExternalBlockHash]:
        """The hashes held on ``medium`` (a copy)."""
        return set(self.by_medium.get(medium, ()))

    def clear(self) -> None:
        """Forget everything (a gap that replay could not fill: rebuild from new events)."""
        self.by_medium.clear()

    def longest_prefix(self, block_hashes: Iterable[ExternalBlockHash], medium: str) -> int:
        """How many leading ``block_hashes`` of a prompt are held on ``medium``."""
        held = self.by_medium.get(medium, set())
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count
