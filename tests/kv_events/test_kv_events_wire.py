"""The event schema on the wire, and the events the block pool reports."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.block_hashes import hash_request_tokens
from pipeline.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSink,
    decode_batch,
    encode_batch,
    external_block_hash,
    prompt_block_digests,
    prompt_block_hashes,
)
from stages.scheduler.block_pool import BlockPool


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A subscriber's view of vLLM's seven-field ``BlockStored`` schema (before lora_name)."""


class _OldBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _OldCleared(_Event, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_OldBlockStored | _OldBlockRemoved | _OldCleared]


def _digest(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


class TestWireFormat:
    def test_batch_is_a_positional_array_with_tagged_events(self) -> None:
        """KVEventBatch encodes as [ts, [events], dp_rank]; each event as [tag, fields...]."""
        batch = KVEventBatch(
            ts=1.5,
            events=[
                BlockStored(
                    block_hashes=[1, 2],
                    parent_block_hash=None,
                    token_ids=[5, 6, 7, 8],
                    block_size=2,
                    lora_id=None,
                    medium="GPU",
                ),
                BlockRemoved(block_hashes=[2], medium="GPU"),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
        plain = msgspec.msgpack.decode(encode_batch(batch))
        assert plain == [
            1.5,
            [
                ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None],
                ["BlockRemoved", [2], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
        assert decode_batch(encode_batch(batch)) == batch

    def test_a_decoder_of_the_older_vllm_schema_reads_it(self) -> None:
        """A subscriber built for the seven-field schema ignores the trailing lora_name."""
        batch = KVEventBatch(
            ts=2.0,
            events=[BlockStored([9], 8, [1, 2], 2, None, "CPU"), AllBlocksCleared()],
        )
        old = msgspec.msgpack.decode(encode_batch(batch), type=_OldBatch)
        assert old.events[0] == _OldBlockStored([9], 8, [1, 2], 2, None, "CPU")
        assert isinstance(old.events[1], _OldCleared)

    def test_decode_refuses_a_wrong_shape(self) -> None:
        """A payload that is not a KVEventBatch raises msgspec's DecodeError."""
        with pytest.raises(msgspec.DecodeError):
            decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", "x"]]]))
        with pytest.raises(msgspec.DecodeError):
            decode_batch(b"\xc1")

    def test_int_hash_is_the_low_64_bits_of_the_digest(self) -> None:
        """As vLLM's maybe_convert_block_hash: the last 8 bytes, big-endian, unsigned."""
        digest = bytes(range(32))
        assert external_block_hash(digest) == int.from_bytes(digest[-8:], "big")
        assert external_block_hash(digest, "bytes") == digest


class TestRouterHashing:
    @given(
        tokens=st.lists(st.integers(0, 50_000), max_size=40),
        block_size=st.integers(1, 8),
        seed=st.integers(-(2**63), 2**63 - 1),
    )
    def test_equals_the_schedulers_hashing(self, tokens, block_size, seed) -> None:
        """prompt_block_digests is pipeline.block_hashes.hash_request_tokens."""
        digests = prompt_block_digests(tokens, block_size, hash_seed=seed)
        assert digests == hash_request_tokens(tokens, block_size, hash_seed=seed)
        wire = prompt_block_hashes(tokens, block_size, hash_seed=seed)
        assert wire == [external_block_hash(d) for d in digests]


class TestPoolEvents:
    def _pool(self, num_blocks: int = 4) -> tuple[BlockPool, KVEventSink]:
        pool = BlockPool(num_blocks)
        # token ids are in the events only on request (include_token_ids), as asked here
        sink = KVEventSink(block_size=2, medium="GPU", hash_format="bytes", include_token_ids=True)
        pool.kv_events = sink
        return pool, sink

    def test_stored_runs_carry_parent_and_tokens(self) -> None:
        """A block already cached under its hash splits the run; each run names its chain
        parent and exactly its tokens."""
        pool, sink = self._pool()
        other = pool.get_new_blocks(1)
        pool.cache_full_blocks(other, [_digest(2)])
        sink.take()
        blocks = pool.get_new_blocks(3)
        tokens = [0, 0, 1, 1, 2, 2, 3, 3, 4]
        pool.cache_full_blocks(
            blocks,
            [_digest(1), _digest(2), _digest(3)],
            parent_hash=_digest(0),
            token_ids=tokens,
            first_token=2,
        )
        assert sink.take() == [
            BlockStored([_digest(1)], _digest(0), [1, 1], 2, None, "GPU"),
            BlockStored([_digest(3)], _digest(2), [3, 3], 2, None, "GPU"),
        ]
        assert set(pool.cached) == {_digest(1), _digest(2), _digest(3)}

    def test_eviction_uncache_and_reset_are_reported(self) -> None:
        """Evicting, uncaching and resetting report exactly the hashes that left."""
        pool, sink = self._pool(2)
        a, b = pool.get_new_blocks(2)
        pool.cache_full_blocks([a, b], [_digest(1), _digest(2)], token_ids=[1, 1, 2, 2])
        assert pool.uncache([b]) == 1
        pool.free_blocks([b, a])
        pool.get_new_blocks(2)  # evicts a (b has no hash any more)
        pool.free_blocks(pool.blocks)
        assert pool.reset_prefix_cache()
        assert sink.take() == [
            BlockStored([_digest(1), _digest(2)], None, [1, 1, 2, 2], 2, None, "GPU"),
            BlockRemoved([_digest(2), _digest(1)], "GPU"),  # in order, one event
            AllBlocksCleared(),
        ]

    def test_consecutive_evictions_share_one_event(self) -> None:
        """Evicting several cached blocks at once gives one BlockRemoved, in order."""
        pool, sink = self._pool(3)
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks, [_digest(i) for i in range(3)], token_ids=[0] * 6)
        pool.free_blocks(blocks)
        sink.take()
        pool.get_new_blocks(3)
        assert sink.take() == [BlockRemoved([_digest(i) for i in range(3)], "GPU")]

    def test_duplicate_hash_is_not_stored_twice(self) -> None:
        """A second block for an already cached hash stays uncached: no event."""
        pool, sink = self._pool(2)
        a, b = pool.get_new_blocks(2)
        pool.cache_full_blocks([a], [_digest(1)], token_ids=[1, 1])
        sink.take()
        assert pool.cache_full_blocks([b], [_digest(1)], token_ids=[1, 1]) == []
        assert pool.uncache([b]) == 0
        assert sink.take() == []

    def test_no_sink_no_events(self) -> None:
        """Without a sink (events off) the pool works as before."""
        pool = BlockPool(2)
        assert pool.kv_events is None
        (a,) = pool.get_new_blocks(1)
        assert pool.cache_full_blocks([a], [_digest(1)]) == [a]


class TestExports:
    def test_every_module_name_is_exported_once(self) -> None:
        """pipeline.kv_events re-exports each submodule's __all__, each name once."""
        import importlib

        import pipeline.kv_events as package

        names = package.__all__
        assert len(names) == len(set(names))
        assert all(hasattr(package, n) for n in names)
        for module in ("config", "events", "index", "publisher", "sink", "subscriber"):
            public = importlib.import_module(f"pipeline.kv_events.{module}").__all__
            assert set(public) <= set(names), module
