"""The offload connector's pure parts: the slot index (LRU), its options and metadata."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from connectors.offload import (
    BlockCopy,
    OffloadMetadata,
    OffloadOptions,
    SlotIndex,
    make_runs,
)
from pipeline.errors import InvalidConfigError


def key(n: int, fp: str = "fp") -> tuple[str, bytes]:
    return (fp, n.to_bytes(32, "big"))


class TestSlotIndex:
    def test_reserved_entry_is_not_found_until_committed(self):
        """A pending save is neither loadable nor counted as committed."""
        index = SlotIndex(2)
        slot = index.reserve(key(1))
        assert slot == 0 and index.lookup(key(1)) is None and key(1) in index
        index.commit(key(1))
        assert index.lookup(key(1)) == 0 and len(index) == 1

    def test_abort_frees_the_slot(self):
        """A failed save gives its slot back and leaves no entry."""
        index = SlotIndex(1)
        index.reserve(key(1))
        index.abort(key(1))
        assert key(1) not in index and index.usage().free == 1
        assert index.reserve(key(2)) == 0

    def test_lru_evicts_least_recently_used(self):
        """When full, the least recently used committed entry is evicted first."""
        index = SlotIndex(2)
        for n in (1, 2):
            index.reserve(key(n))
            index.commit(key(n))
        index.touch(key(1))
        slot = index.reserve(key(3))
        assert slot is not None and index.lookup(key(2)) is None and index.lookup(key(1)) == 0

    def test_pinned_and_pending_slots_are_never_evicted(self):
        """Pinned (being loaded) and pending slots are skipped; nothing left gives None."""
        index = SlotIndex(2)
        index.reserve(key(1))
        index.commit(key(1))
        index.pin(0)
        index.reserve(key(2))  # slot 1, pending
        assert index.reserve(key(3)) is None
        index.unpin(0)
        assert index.reserve(key(3)) == 0 and index.lookup(key(1)) is None

    def test_discarding_a_pinned_slot_frees_it_on_the_last_unpin(self):
        """A slot that failed to load while another load pins it is freed only after."""
        index = SlotIndex(1)
        index.reserve(key(1))
        index.commit(key(1))
        index.pin(0)
        index.pin(0)
        index.discard(key(1))
        assert index.lookup(key(1)) is None and index.usage().orphaned == 1
        index.unpin(0)
        assert index.usage().free == 0
        index.unpin(0)
        assert index.usage().free == 1 and index.usage().orphaned == 0

    def test_same_hash_under_another_fingerprint_is_another_key(self):
        """A block hash stored for one model never matches under another fingerprint."""
        index = SlotIndex(2)
        index.reserve(key(1, "model-a"))
        index.commit(key(1, "model-a"))
        assert index.lookup(key(1, "model-b")) is None

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["reserve", "commit", "abort", "discard", "pin", "unpin"]),
                st.integers(0, 7),
            ),
            max_size=60,
        )
    )
    def test_every_slot_is_in_exactly_one_state(self, ops):
        """Under any sequence of operations, free + pending + committed + orphaned = n."""
        index = SlotIndex(4)
        pins: list[int] = []
        for op, n in ops:
            if op == "reserve" and key(n) not in index:
                index.reserve(key(n))
            elif op == "commit":
                index.commit(key(n))
            elif op == "abort":
                index.abort(key(n))
            elif op == "discard":
                index.discard(key(n))
            elif op == "pin" and (slot := index.lookup(key(n))) is not None:
                index.pin(slot)
                pins.append(slot)
            elif op == "unpin" and pins:
                index.unpin(pins.pop())
            usage = index.usage()
            assert usage.free + usage.pending + usage.committed + usage.orphaned == 4
            slots = [index.lookup(key(m)) for m in range(8)]
            held = [s for s in slots if s is not None]
            assert len(held) == len(set(held))


class TestOffloadOptions:
    def test_num_blocks(self):
        """num_blocks is the slot count; everything else has defaults."""
        options = OffloadOptions.from_options({"num_blocks": 8})
        assert options.num_blocks == 8 and not options.async_load

    def test_capacity_bytes_needs_block_bytes(self):
        """capacity_bytes is converted with block_bytes, and refused without it."""
        options = OffloadOptions.from_options({"capacity_bytes": 1000, "block_bytes": 300})
        assert options.num_blocks == 3 and options.block_bytes == 300
        with pytest.raises(InvalidConfigError, match="block_bytes"):
            OffloadOptions.from_options({"capacity_bytes": 1000})

    @pytest.mark.parametrize(
        ("options", "names"),
        [
            ({}, "num_blocks"),
            ({"num_blocks": 2, "capacity_bytes": 10}, "exactly one"),
            ({"num_blocks": 0}, "num_blocks"),
            ({"num_blocks": True}, "num_blocks"),
            ({"num_blocks": 2, "colour": "red"}, "colour"),
            ({"num_blocks": 2, "async_load": "yes"}, "async_load"),
            ({"num_blocks": 2, "load_timeout_s": 0}, "load_timeout_s"),
            ({"capacity_bytes": 10, "block_bytes": 300}, "at least one block"),
        ],
    )
    def test_bad_options_name_the_option(self, options, names):
        """Each bad option raises InvalidConfigError naming it and what is allowed."""
        with pytest.raises(InvalidConfigError, match=names):
            OffloadOptions.from_options(options)


class TestOffloadMetadata:
    def test_bytes_round_trip(self):
        """Metadata survives to_bytes/from_bytes (msgpack, no pickle) unchanged."""
        loads = [BlockCopy("a", 3, 1, b"\x01" * 32), BlockCopy("a", 4, 2, b"\x02" * 32)]
        saves = [BlockCopy("b", 9, 0, b"\x03" * 32)]
        meta = OffloadMetadata.build(7, loads, saves, {"a"})
        back = OffloadMetadata.from_bytes(meta.to_bytes())
        assert back == meta and back.loads() == loads and back.saves() == saves
        assert back.async_req_ids == ("a",)

    def test_empty_step(self):
        """A step with nothing to move still has metadata (never None)."""
        meta = OffloadMetadata.build(0, [], [], set())
        assert OffloadMetadata.from_bytes(meta.to_bytes()) == meta and meta.loads() == []


class TestMakeRuns:
    def test_consecutive_slots_and_blocks_coalesce(self):
        """Consecutive slot/block pairs become one run; a break starts a new one."""
        runs = make_runs([(0, 10, "a"), (1, 11, "a"), (2, 12, "b"), (5, 13, "b")])
        assert [(r.slot, r.block, r.length) for r in runs] == [(0, 10, 3), (5, 13, 1)]
        assert runs[0].req_ids == {"a", "b"}
