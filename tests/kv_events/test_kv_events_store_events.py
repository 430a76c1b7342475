"""``StoreEvents``, the announced set of a store tier: each hash stored once and removed
once, probes read as far as they say, failed loads probed again; and the shared_storage
scheduler's own eviction reported for its fingerprint only."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from connectors.base import ConnectorContext, KVConnectorOutput, KVConnectorRole, ModelFingerprint
from connectors.shared_storage import MEDIUM_DISK, DiskStore, SharedStorageScheduler
from connectors.store import StoreEvents
from pipeline.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVEventSink,
    external_block_hash,
)

BLOCK = 4


def _digest(n: int) -> bytes:
    return n.to_bytes(32, "big")


def _events() -> tuple[StoreEvents, KVEventSink]:
    sink = KVEventSink(BLOCK, MEDIUM_DISK, "bytes")
    return StoreEvents(sink), sink


def _stored(*ns: int) -> BlockStored:
    return BlockStored([_digest(n) for n in ns], None, [], BLOCK, None, MEDIUM_DISK)


def _removed(*ns: int) -> BlockRemoved:
    return BlockRemoved([_digest(n) for n in ns], MEDIUM_DISK)


class TestStoreEvents:
    def test_each_hash_is_stored_once_and_removed_once(self) -> None:
        """Storing a held hash or removing one never announced says nothing."""
        events, sink = _events()
        events.stored([_digest(1), _digest(2), _digest(1)])
        events.stored([_digest(2)])
        events.removed([_digest(3), _digest(1), _digest(1)])
        assert sink.take() == [_stored(1, 2), _removed(1)]
        assert events.announced.keys() == {_digest(2)}

    def test_the_announced_set_is_bounded_oldest_out_first(self) -> None:
        """Past ``max_announced`` the oldest announced hash is removed, then the new one
        stored: a router forgets a block it may still find, never invents one."""
        sink = KVEventSink(BLOCK, MEDIUM_DISK, "bytes")
        events = StoreEvents(sink, max_announced=2)
        events.stored([_digest(1), _digest(2)])
        events.removed([_digest(1)])
        events.stored([_digest(3), _digest(4)])
        assert sink.take() == [_stored(1, 2), _removed(1), _stored(3), _removed(2), _stored(4)]
        assert list(events.announced) == [_digest(3), _digest(4)]

    def test_a_probe_says_its_leading_run_and_first_miss_only(self) -> None:
        """Found, found, missing, (unchecked): the run is stored, the first miss removed,
        the rest untouched; a probe that could not ask (no entries) says nothing."""
        events, sink = _events()
        events.stored([_digest(3), _digest(4)])
        sink.take()
        hashes = tuple(_digest(n) for n in (1, 2, 3, 4))
        events.probed(hashes, [True, True, False, False])
        assert sink.take() == [_stored(1, 2), _removed(3)]
        events.probed(hashes, [])
        assert sink.take() == [] and events.announced.keys() == {_digest(n) for n in (1, 2, 4)}

    def test_a_failed_load_is_probed_again(self) -> None:
        """Failed loads: announced hashes are probed once each (missing: removed;
        present: kept); hashes never announced are not probed."""
        events, sink = _events()
        events.stored([_digest(1), _digest(2)])
        sink.take()
        asked: list[tuple[bytes, ...]] = []

        def probe(hashes: tuple[bytes, ...]) -> Sequence[bool]:
            asked.append(hashes)
            return [hashes[0] == _digest(2)]

        events.recheck([_digest(1), _digest(2), _digest(1), _digest(9)], probe)
        assert asked == [(_digest(1),), (_digest(2),)]
        assert sink.take() == [_removed(1)] and events.announced.keys() == {_digest(2)}


def _scheduler(root: Path, **options: object) -> SharedStorageScheduler:
    fp = ModelFingerprint(architecture="A", weights_id="w", dtype="float32", block_size=BLOCK)
    context = ConnectorContext(
        role=KVConnectorRole.SCHEDULER,
        options={"path": str(root), **options},
        block_size=BLOCK,
        fingerprint=fp,
    )
    return SharedStorageScheduler(context)


class TestSharedStorageEviction:
    def test_own_eviction_is_removed_for_this_fingerprint_only(self, tmp_path: Path) -> None:
        """Over the cap, the scheduler evicts after a step's saves landed: the evicted
        values of its fingerprint are removed; another model's evicted value is not its
        to report. What stays announced is what is left."""
        scheduler = _scheduler(tmp_path, max_bytes=300)
        sink = KVEventSink(BLOCK, MEDIUM_GPU)
        scheduler.set_kv_event_sink(sink)
        key = scheduler.fingerprint_keys[0]
        store = DiskStore(tmp_path)
        store.write("ab" * 16, _digest(0), b"x" * 100)  # another model's, the oldest
        for n in range(1, 5):
            store.write(key, _digest(n), b"x" * 100)
        for age, (fp, n) in enumerate([("ab" * 16, 0), *((key, n) for n in range(1, 5))]):
            os.utime(store.path_for(fp, _digest(n)), (1_000_000 + age, 1_000_000 + age))
        assert scheduler.kv_events is not None
        scheduler.kv_events.stored([_digest(n) for n in range(1, 5)])  # 4: this step's
        sink.take()
        scheduler.settle([_digest(4)], [])  # 500 bytes over a cap of 300: down to 270
        removed = [external_block_hash(_digest(n)) for n in (1, 2)]
        assert sink.take() == [BlockRemoved(removed, MEDIUM_DISK)]
        assert not store.contains("ab" * 16, _digest(0))
        left = {n for n in range(1, 5) if store.contains(key, _digest(n))}
        assert (
            left == {3, 4} == {n for n in range(5) if _digest(n) in scheduler.kv_events.announced}
        )

    def test_no_output_no_eviction(self, tmp_path: Path) -> None:
        """update_connector_output without a built step (events on) changes nothing."""
        scheduler = _scheduler(tmp_path, max_bytes=1)
        sink = KVEventSink(BLOCK, MEDIUM_GPU)
        scheduler.set_kv_event_sink(sink)
        scheduler.update_connector_output(KVConnectorOutput())
        assert sink.take() == []
