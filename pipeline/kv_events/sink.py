"""``KVEventSink``: where a cache tier writes its events until the step's batch is made.

A sink is made only while events are on: the block pool holds one
(``BlockPool.kv_events``, else ``None``: then no event object is ever made), and a
connector tier that publishes gets one through ``set_kv_event_sink`` and derives its own
with :meth:`KVEventSink.for_medium`. The sinks of one engine share one list, so the
step's events keep the order in which they happened across tiers. The tiers call
:meth:`stored`, :meth:`stored_hash`, :meth:`removed` and :meth:`cleared` with their
32-byte digests; the sink turns them into events in the wire's hash format, and
:meth:`take` hands the step's events over.

``BlockStored`` carries token ids only from a sink made with ``include_token_ids``
(``KVEventsConfig.include_token_ids``): by default an event holds hashes, never the
prompt's tokens.

Plain synchronous code on the engine's thread (the scheduler's); not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pipeline.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_block_hash,
)

if TYPE_CHECKING:
    from pipeline.lora import LoRAAdapter

__all__ = ["KVEventSink"]


class KVEventSink:
    """Collects one cache tier's events, in order.

    Args:
        block_size: Tokens per block of the tier.
        medium: The tier's ``medium`` (``"GPU"``, ``"CPU"``, ...).
        hash_format: How hashes appear in events (see
            :func:`~pipeline.kv_events.events.external_block_hash`).
        events: The list to append to (shared with other tiers' sinks, see
            :meth:`for_medium`); a new one by default.
    """

    __slots__ = ("_hash_format", "block_size", "events", "include_token_ids", "medium")

    def __init__(
        self,
        block_size: int,
        medium: str,
        hash_format: Literal["int", "bytes"] = "int",
        events: list[KVEvent] | None = None,
        *,
        include_token_ids: bool = False,
    ) -> None:
        self.block_size = block_size
        self.medium = medium
        self._hash_format: Literal["int", "bytes"] = hash_format
        self.events: list[KVEvent] = [] if events is None else events
        self.include_token_ids = include_token_ids

    def for_medium(self, medium: str) -> KVEventSink:
        """A sink for another tier (``medium``, same block size, hash format and
        ``include_token_ids``) that appends to this sink's list: one :meth:`take` on
        either hands over both tiers' events, in the order they happened."""
        return KVEventSink(
            self.block_size,
            medium,
            self._hash_format,
            self.events,
            include_token_ids=self.include_token_ids,
        )

    def stored(
        self,
        digests: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        lora: LoRAAdapter | None = None,
    ) -> None:
        """Blocks with these chained ``digests`` (a run in prefix order, after ``parent``)
        and ``len(digests) * block_size`` ``token_ids`` entered the cache, computed with
        ``lora`` (or the base model); the event carries the tokens only when the sink was
        made with ``include_token_ids``."""
        fmt = self._hash_format
        self.events.append(
            BlockStored(
                block_hashes=[external_block_hash(d, fmt) for d in digests],
                parent_block_hash=None if parent is None else external_block_hash(parent, fmt),
                token_ids=[int(t) for t in token_ids] if self.include_token_ids else [],
                block_size=self.block_size,
                lora_id=None if lora is None else lora.int_id,
                medium=self.medium,
                lora_name=None if lora is None else lora.name,
            )
        )

    def stored_hash(self, digest: bytes) -> None:
        """The block ``digest`` entered a tier that keeps hashes, not tokens: a
        ``BlockStored`` with no ``token_ids`` and no ``parent_block_hash``, as vLLM's
        offloading connector sends. Consecutive calls of one medium share one event."""
        value = external_block_hash(digest, self._hash_format)
        events = self.events
        if events:
            last = events[-1]
            if (
                type(last) is BlockStored
                and last.medium == self.medium
                and last.parent_block_hash is None
                and not last.token_ids
            ):
                last.block_hashes.append(value)
                return
        events.append(
            BlockStored(
                block_hashes=[value],
                parent_block_hash=None,
                token_ids=[],
                block_size=self.block_size,
                lora_id=None,
                medium=self.medium,
            )
        )

    def removed(self, digest: bytes) -> None:
        """The hash ``digest`` left the cache. Consecutive removals of one medium share
        one event."""
        value = external_block_hash(digest, self._hash_format)
        events = self.events
        if events:
            last = events[-1]
            if type(last) is BlockRemoved and last.medium == self.medium:
                last.block_hashes.append(value)
                return
        events.append(BlockRemoved(block_hashes=[value], medium=self.medium))

    def cleared(self) -> None:
        """Every hash left the cache."""
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, of every sink sharing the list (oldest
        first); the list is emptied in place."""
        events = self.events[:]
        self.events.clear()
        return events
