"""The pool of KV-cache blocks: reference counts, an LRU free queue, the prefix cache.

A block is *in use* while its reference count is positive (one reference per request
whose block table holds it). A block with no reference sits in the free queue, oldest
first; if it is full and cached it keeps its hash there and can still be hit by a later
request (which takes it back out of the queue), until :meth:`BlockPool.get_new_blocks`
evicts it, least recently freed first, and drops its hash.

With KV events on, :attr:`BlockPool.kv_events` is a
:class:`~pipeline.kv_events.KVEventSink` and the pool reports each hash entering the
prefix cache (``BlockStored``), leaving it (``BlockRemoved``: eviction, :meth:`uncache`)
and :meth:`reset_prefix_cache` (``AllBlocksCleared``), so that the events describe
:attr:`BlockPool.cached` exactly. Off (``None``, the default), no event is made.

The pool is plain synchronous bookkeeping, owned by one scheduler; it is not
thread-safe and never blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pipeline.checks import check_int
from pipeline.errors import InvalidConfigError

if TYPE_CHECKING:
    from pipeline.kv_events.sink import KVEventSink
    from pipeline.lora import LoRAAdapter

__all__ = ["BlockPool", "KVCacheBlock"]


class KVCacheBlock:
    """Metadata of one KV block (the KV itself lives in the workers' paged cache).

    Attributes:
        block_id: Index of the block in the paged cache, ``0 <= block_id < num_blocks``.
        ref_cnt: Number of requests whose block table holds this block.
        block_hash: Chained hash of the full block's tokens when the block is in the
            prefix cache, else ``None``.
    """

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class BlockPool:
    """Every KV block of one engine, with a prefix cache keyed by chained block hashes.

    Args:
        num_blocks: Number of blocks in the paged cache.
        enable_caching: Whether full blocks may be registered in the prefix cache; when
            ``False``, :meth:`cache_full_blocks` and :meth:`get_cached_block` do nothing.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        check_int("num_blocks", num_blocks, InvalidConfigError, lo=1)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; OrderedDict gives O(1) removal by id.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.kv_events: KVEventSink | None = None
        """Where the pool reports cache changes while KV events are on, else ``None``."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not): what an allocation may use."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self.cached)

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in eviction order (next evicted first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block cached under ``block_hash``, or ``None``. Does not touch it."""
        if not self.enable_caching:
            return None
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, least recently freed first, with ref_cnt 1.

        A cached block taken this way is evicted: its hash leaves the prefix cache.

        Raises:
            RuntimeError: ``num_blocks`` exceeds :attr:`num_free_blocks` (callers check
                first; this is an internal invariant, not user input).
        """
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free"
            )
        taken: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order; a block reaching zero
        joins the tail of the free queue (so it is evicted after those freed before it).

        Callers free a request's table in reverse so its tail blocks are evicted first.

        Raises:
            RuntimeError: A block is already free (a double free: an internal bug).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        *,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] = (),
        first_token: int = 0,
        lora: LoRAAdapter | None = None,
    ) -> list[KVCacheBlock]:
        """Register each full block under its hash (pairwise).

        A block that already has a hash is left as it is. When another block is already
        cached under the same hash (the same prefix computed twice), the new block stays
        uncached and the existing entry wins.

        Args:
            blocks: Consecutive full blocks of one request.
            block_hashes: Their chained hashes.
            parent_hash: The hash of the request's block before ``blocks[0]`` (``None``
                when ``blocks[0]`` starts the request); read only by KV events.
            token_ids: Tokens from which ``token_ids[first_token:]`` are those of
                ``blocks`` (the request's whole token list: no copy is made unless KV
                events are on, when they are read).
            first_token: See ``token_ids``.
            lora: The LoRA adapter that computed them (read only by KV events).

        Returns:
            The blocks registered by this call.
        """
        if not self.enable_caching:
            return []
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        registered: list[KVCacheBlock] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            registered.append(block)
        if self.kv_events is not None and registered:
            self._report_stored(
                registered, blocks, block_hashes, parent_hash, token_ids, first_token, lora
            )
        return registered

    def _report_stored(
        self,
        registered: list[KVCacheBlock],
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        first_token: int,
        lora: LoRAAdapter | None,
    ) -> None:
        """One ``BlockStored`` per run of consecutive ``blocks`` that were ``registered``."""
        sink = self.kv_events
        assert sink is not None
        size = sink.block_size
        new = {block.block_id for block in registered}
        start: int | None = None
        for index in range(len(blocks) + 1):
            inside = index < len(blocks) and blocks[index].block_id in new
            if inside and start is None:
                start = index
            elif not inside and start is not None:
                parent = block_hashes[start - 1] if start else parent_hash
                first = first_token + start * size
                tokens = token_ids[first : first + (index - start) * size]
                sink.stored(block_hashes[start:index], parent, tokens, lora)
                start = None

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Remove blocks from the prefix cache (their KV must not be reused).

        Blocks stay allocated or free as they were. Returns how many were uncached.
        """
        count = 0
        for block in blocks:
            if block.block_hash is not None and self._evict(block):
                count += 1
        return count

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only allowed when no block is in use.

        Returns:
            ``True`` if the cache was reset, ``False`` when blocks are still in use.
        """
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def leak_report(self) -> dict[int, int]:
        """``{block_id: ref_cnt}`` of every block in use (empty when nothing is held)."""
        return {b.block_id: b.ref_cnt for b in self.blocks if b.ref_cnt > 0}

    def _evict(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        block.block_hash = None
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block_hash)
            return True
        return False
