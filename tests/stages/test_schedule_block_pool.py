"""The block pool (LRU free queue, ref counts, prefix cache) and the KV cache manager."""

from __future__ import annotations

import pytest

from pipeline.block_hashes import BlockHasher
from pipeline.config import SamplingParams
from pipeline.errors import InvalidConfigError
from pipeline.request import Request
from stages.scheduler.block_pool import BlockPool
from stages.scheduler.kv_manager import MAX_UNAPPLIED_STEPS, KVCacheManager


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


class TestBlockPool:
    def test_new_pool_is_all_free_in_id_order(self) -> None:
        """A fresh pool hands out blocks in id order."""
        pool = BlockPool(4)
        assert pool.num_free_blocks == 4
        assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
        assert pool.num_free_blocks == 1

    def test_freed_blocks_are_reused_least_recently_freed_first(self) -> None:
        """The free queue is LRU: blocks freed earlier are taken first."""
        pool = BlockPool(4)
        blocks = pool.get_new_blocks(4)
        pool.free_blocks([blocks[2]])
        pool.free_blocks([blocks[0]])
        pool.free_blocks([blocks[3]])
        assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 0, 3]

    def test_eviction_drops_the_hash_of_a_cached_free_block(self) -> None:
        """Allocating a cached free block evicts it from the prefix cache."""
        pool = BlockPool(2)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks, [_hash(1), _hash(2)])
        pool.free_blocks(reversed(blocks))
        assert pool.get_cached_block(_hash(2)) is blocks[1]
        (evicted,) = pool.get_new_blocks(1)
        assert evicted is blocks[1]  # freed first (reverse order) so evicted first
        assert evicted.block_hash is None
        assert pool.get_cached_block(_hash(2)) is None
        assert pool.get_cached_block(_hash(1)) is blocks[0]

    def test_touch_revives_a_cached_free_block(self) -> None:
        """Touching a free cached block takes it out of the free queue with ref_cnt 1."""
        pool = BlockPool(3)
        (block,) = pool.get_new_blocks(1)
        pool.cache_full_blocks([block], [_hash(5)])
        pool.free_blocks([block])
        assert pool.num_free_blocks == 3
        pool.touch([block])
        assert block.ref_cnt == 1
        assert pool.num_free_blocks == 2
        assert block.block_id not in pool.free_block_ids()

    def test_shared_block_is_free_only_when_every_owner_frees_it(self) -> None:
        """Reference counting: a block returns to the queue at ref_cnt 0 only."""
        pool = BlockPool(2)
        (block,) = pool.get_new_blocks(1)
        pool.touch([block])
        pool.free_blocks([block])
        assert block.ref_cnt == 1
        assert pool.num_free_blocks == 1
        pool.free_blocks([block])
        assert pool.num_free_blocks == 2

    def test_double_free_raises(self) -> None:
        """Freeing a free block is refused."""
        pool = BlockPool(1)
        (block,) = pool.get_new_blocks(1)
        pool.free_blocks([block])
        with pytest.raises(RuntimeError, match="double free"):
            pool.free_blocks([block])
        assert pool.num_free_blocks == 1

    def test_over_allocation_raises(self) -> None:
        """Asking for more blocks than are free is refused without changing the pool."""
        pool = BlockPool(2)
        with pytest.raises(RuntimeError, match="only 2 are free"):
            pool.get_new_blocks(3)
        assert pool.num_free_blocks == 2

    def test_duplicate_hash_keeps_the_first_block(self) -> None:
        """A second block with an already cached hash stays uncached."""
        pool = BlockPool(2)
        a, b = pool.get_new_blocks(2)
        assert pool.cache_full_blocks([a], [_hash(1)]) == [a]
        assert pool.cache_full_blocks([b], [_hash(1)]) == []
        assert b.block_hash is None
        assert pool.get_cached_block(_hash(1)) is a

    def test_uncache_removes_entries(self) -> None:
        """uncache takes blocks out of the prefix cache but leaves them allocated."""
        pool = BlockPool(2)
        a, b = pool.get_new_blocks(2)
        pool.cache_full_blocks([a, b], [_hash(1), _hash(2)])
        assert pool.uncache([a, b]) == 2
        assert pool.num_cached_blocks == 0
        assert a.ref_cnt == 1

    def test_caching_disabled_caches_nothing(self) -> None:
        """With caching off, nothing is registered or found."""
        pool = BlockPool(1, enable_caching=False)
        blocks = pool.get_new_blocks(1)
        assert pool.cache_full_blocks(blocks, [_hash(1)]) == []
        assert pool.get_cached_block(_hash(1)) is None

    def test_leak_report_lists_blocks_in_use(self) -> None:
        """leak_report names every block with a positive ref count."""
        pool = BlockPool(3)
        blocks = pool.get_new_blocks(2)
        pool.touch(blocks[:1])
        assert pool.leak_report() == {0: 2, 1: 1}
        pool.free_blocks(blocks)
        pool.free_blocks(blocks[:1])
        assert pool.leak_report() == {}

    def test_rejects_bad_size(self) -> None:
        """A non-positive pool size is refused, naming the field."""
        with pytest.raises(InvalidConfigError, match="num_blocks"):
            BlockPool(0)


def _request(req_id: str, tokens: list[int], hasher: BlockHasher) -> Request:
    request = Request(req_id, tokens, SamplingParams())
    hasher.update(request)
    return request


class TestKVCacheManager:
    def test_computed_blocks_never_cover_the_whole_prompt(self) -> None:
        """A fully cached prompt still leaves its last block to compute."""
        hasher = BlockHasher(4)
        kv = KVCacheManager(8, 4)
        first = _request("a", list(range(8)), hasher)
        assert kv.allocate_slots(first, 8) is not None
        second = _request("b", list(range(8)), hasher)
        hit = kv.get_computed_blocks(second)
        assert hit.num_computed_tokens == 4
        assert [b.block_id for b in hit.blocks] == kv.get_block_ids("a")[:1]

    def test_allocation_reuses_hits_and_counts_tokens(self) -> None:
        """allocate_slots takes a reference on the hit blocks and adds new ones."""
        hasher = BlockHasher(4)
        kv = KVCacheManager(8, 4)
        first = _request("a", list(range(10)), hasher)
        kv.allocate_slots(first, 10)
        second = _request("b", [*range(8), 50, 51], hasher)
        hit = kv.get_computed_blocks(second)
        new = kv.allocate_slots(second, 2, hit.num_computed_tokens, hit.blocks)
        assert new is not None and len(new) == 1
        assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
        assert [b.ref_cnt for b in kv.get_blocks("b")] == [2, 2, 1]

    def test_allocation_fails_atomically(self) -> None:
        """Without enough free blocks, allocation returns None and changes nothing."""
        hasher = BlockHasher(4)
        kv = KVCacheManager(2, 4)
        request = _request("a", list(range(12)), hasher)
        assert kv.allocate_slots(request, 12) is None
        assert kv.num_free_blocks == 2
        assert not kv.has_blocks("a")

    def test_free_releases_tail_first(self) -> None:
        """Freeing a request puts its tail block at the head of the eviction order."""
        hasher = BlockHasher(4)
        kv = KVCacheManager(4, 4)
        request = _request("a", list(range(12)), hasher)
        kv.allocate_slots(request, 12)
        kv.free(request)
        assert kv.block_pool.free_block_ids() == [3, 2, 1, 0]

    def test_uncache_step_blocks_forgets_this_steps_entries(self) -> None:
        """Blocks a request cached this step leave the cache; entries of steps whose
        output was applied stay."""
        hasher = BlockHasher(4)
        kv = KVCacheManager(8, 4)
        request = _request("a", list(range(8)), hasher)
        kv.start_step(0)
        kv.allocate_slots(request, 4)
        kv.forget_step(0)
        request.num_computed_tokens = 4
        kv.start_step(1)
        kv.allocate_slots(request, 4)
        assert kv.block_pool.num_cached_blocks == 2
        assert kv.uncache_step_blocks("a") == 1
        assert [b.block_hash is not None for b in kv.get_blocks("a")] == [True, False]

    def test_uncache_step_blocks_reaches_a_step_not_yet_applied(self) -> None:
        """With a step scheduled ahead (its predecessor's output not applied yet), the
        entries of both unapplied steps leave the cache; the bound keeps the records
        of at most MAX_UNAPPLIED_STEPS steps."""
        hasher = BlockHasher(4)
        kv = KVCacheManager(8, 4)
        request = _request("a", list(range(8)), hasher)
        kv.start_step(0)
        kv.allocate_slots(request, 4)
        request.num_computed_tokens = 4
        kv.start_step(1)
        kv.allocate_slots(request, 4)
        assert kv.block_pool.num_cached_blocks == 2
        assert kv.uncache_step_blocks("a") == 2
        assert [b.block_hash is not None for b in kv.get_blocks("a")] == [False, False]
        for step in range(2, 2 + MAX_UNAPPLIED_STEPS):
            kv.start_step(step)
        assert len(kv._unapplied) == MAX_UNAPPLIED_STEPS
