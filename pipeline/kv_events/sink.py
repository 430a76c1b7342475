"""``KVEventSink``: where a cache tier writes its events until the step's batch is made.

The block pool holds a sink only while events are on (``BlockPool.kv_events``, else
``None``: then no event object is ever made). The pool calls :meth:`stored`,
:meth:`removed` and :meth:`cleared` with its 32-byte digests; the sink turns them into
events in the wire's hash format, and :meth:`take` hands the step's events over.

Plain synchronous code on the engine's thread (the scheduler's); not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeline.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_block_hash,
)

__all__ = ["KVEventSink"]


class KVEventSink:
    """Collects one cache tier's events, in order.

    Args:
        block_size: Tokens per block of the tier.
        medium: The tier's ``medium`` (``"GPU"``, ``"CPU"``, ...).
        hash_format: How hashes appear in events (see
            :func:`~pipeline.kv_events.events.external_block_hash`).
    """

    __slots__ = ("_hash_format", "block_size", "events", "medium")

    def __init__(
        self, block_size: int, medium: str, hash_format: Literal["int", "bytes"] = "int"
    ) -> None:
        self.block_size = block_size
        self.medium = medium
        self._hash_format: Literal["int", "bytes"] = hash_format
        self.events: list[KVEvent] = []

    def stored(
        self, digests: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]
    ) -> None:
        """Blocks with these chained ``digests`` (a run in prefix order, after ``parent``)
        and ``len(digests) * block_size`` ``token_ids`` entered the cache."""
        fmt = self._hash_format
        self.events.append(
            BlockStored(
                block_hashes=[external_block_hash(d, fmt) for d in digests],
                parent_block_hash=None if parent is None else external_block_hash(parent, fmt),
                token_ids=[int(t) for t in token_ids],
                block_size=self.block_size,
                lora_id=None,
                medium=self.medium,
            )
        )

    def removed(self, digest: bytes) -> None:
        """The hash ``digest`` left the cache. Consecutive removals share one event."""
        value = external_block_hash(digest, self._hash_format)
        events = self.events
        if events and type(events[-1]) is BlockRemoved:
            last = events[-1]
            assert isinstance(last, BlockRemoved)
            last.block_hashes.append(value)
        else:
            events.append(BlockRemoved(block_hashes=[value], medium=self.medium))

    def cleared(self) -> None:
        """Every hash left the cache."""
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call (oldest first); the sink starts empty again."""
        events, self.events = self.events, []
        return events
