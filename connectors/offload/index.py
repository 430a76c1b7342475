"""``SlotIndex``: the scheduler half's map of what the host-memory tier holds, with LRU.

Every slot is in exactly one state::

    free ──reserve──► pending ──commit──► committed ──evict (LRU)──► pending (new key)
      ▲                  │                    │
      └──────abort───────┘◄──────discard──────┘   (a pinned slot is freed on its last unpin)

Only committed entries are found by :meth:`lookup`; pending entries (a save whose step
has not come back yet) are neither loadable nor evictable, and pinned slots (being
loaded) are never evicted. Keys are ``(fingerprint_key, block_hash)``, so KV is never
matched for a model it was not made by. Owned by one scheduler; not thread-safe; never
blocks.

With KV events on, :attr:`SlotIndex.kv_events` is the tier's
:class:`~pipeline.kv_events.KVEventSink` (else ``None``, and no event is made): a key
entering the committed state is reported stored (:meth:`~SlotIndex.commit`, that is once
its save is confirmed), and one leaving it removed (evicted by :meth:`~SlotIndex.reserve`,
or :meth:`~SlotIndex.discard`). Pending entries are never reported: a save that failed
(:meth:`~SlotIndex.abort`) was never announced. So the events describe the committed
keys exactly: with one fingerprint (one scheduler), each ``block_hash`` is stored once
and removed once.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pipeline.kv_events.sink import KVEventSink

__all__ = ["BlockKey", "SlotIndex", "SlotUsage"]

BlockKey = tuple[str, bytes]
"""``(ModelFingerprint.key(), block_hash)``: what a slot holds."""


class SlotUsage(NamedTuple):
    """How many slots are in each state; they always add up to ``num_slots``."""

    free: int
    pending: int
    committed: int
    orphaned: int
    pinned: int


class SlotIndex:
    """A fixed number of slots, LRU-evicted, keyed by :data:`BlockKey`.

    Args:
        num_slots: Slots in the tier (> 0; the caller validates it).

    Attributes:
        kv_events: Where committed keys' hashes are reported as stored and removed
            (see the module docstring); ``None`` while events are off.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(reversed(range(num_slots)))  # pop() gives slot 0 first
        self._committed: OrderedDict[BlockKey, int] = OrderedDict()  # oldest first
        self._pending: dict[BlockKey, int] = {}
        self._pins: Counter[int] = Counter()
        self._orphans: set[int] = set()  # discarded while pinned: freed on the last unpin
        self.kv_events: KVEventSink | None = None

    def __len__(self) -> int:
        """Committed entries (what a lookup can find)."""
        return len(self._committed)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is committed or pending (a save of it is unnecessary)."""
        return key in self._committed or key in self._pending

    def committed(self) -> list[BlockKey]:
        """The committed keys (what the tier holds and a lookup finds), least recently
        used first."""
        return list(self._committed)

    def lookup(self, key: BlockKey) -> int | None:
        """The slot of committed ``key``, or ``None`` (pending entries are not found)."""
        return self._committed.get(key)

    def touch(self, key: BlockKey) -> None:
        """Mark committed ``key`` most recently used (no-op when it is not committed)."""
        if key in self._committed:
            self._committed.move_to_end(key)

    def pin(self, slot: int) -> None:
        """Protect ``slot`` from eviction while it is loaded (pins count)."""
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """Undo one :meth:`pin`; an orphaned slot is freed on its last unpin."""
        count = self._pins[slot] - 1
        if count > 0:
            self._pins[slot] = count
            return
        del self._pins[slot]
        if slot in self._orphans:
            self._orphans.discard(slot)
            self._free.append(slot)

    def reserve(self, key: BlockKey) -> int | None:
        """A slot for saving ``key``: a free one, else the least recently used committed
        entry that is not pinned (evicted). The entry is pending until :meth:`commit`.

        Returns:
            The slot, or ``None`` when every slot is pending or pinned.
        """
        if key in self:
            raise AssertionError(f"key {key!r} is already stored")  # callers check first
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._committed.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._committed.pop(victim)
            if self.kv_events is not None:
                self.kv_events.removed(victim[1])
        self._pending[key] = slot
        return slot

    def commit(self, key: BlockKey) -> None:
        """The save of ``key`` succeeded: it becomes loadable (most recently used)."""
        slot = self._pending.pop(key, None)
        if slot is not None:
            self._committed[key] = slot
            if self.kv_events is not None:
                self.kv_events.stored_hash(key[1])

    def abort(self, key: BlockKey) -> None:
        """The save of ``key`` failed or never ran: its slot is free again."""
        slot = self._pending.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def discard(self, key: BlockKey) -> None:
        """Forget committed ``key`` (its slot failed to load); no-op when absent."""
        slot = self._committed.pop(key, None)
        if slot is None:
            return
        if self.kv_events is not None:
            self.kv_events.removed(key[1])
        if slot in self._pins:
            self._orphans.add(slot)
        else:
            self._free.append(slot)

    def usage(self) -> SlotUsage:
        """Counts per state (``pinned`` overlaps the others)."""
        return SlotUsage(
            free=len(self._free),
            pending=len(self._pending),
            committed=len(self._committed),
            orphaned=len(self._orphans),
            pinned=len(self._pins),
        )
