"""Per-request block tables on top of the :class:`BlockPool`, with prefix-cache lookup.

A request's block table only grows while it holds blocks; it is released whole by
:meth:`KVCacheManager.free` (finish, abort, preemption). Full blocks are registered in
the prefix cache when they are allocated for tokens computed in the current step (as
vLLM V1 does), so a request scheduled later in the same step can already hit them; the
forward pass therefore writes a layer's KV for the whole batch before attention reads
it. If that step fails, :meth:`KVCacheManager.uncache_step_blocks` takes those entries
back out so nobody reuses KV that was never written. The entries are remembered per
step until the step's output is applied (:meth:`KVCacheManager.forget_step`), so with
a step scheduled ahead (async scheduling) a failure of either step finds them.

Synchronous bookkeeping owned by one scheduler; not thread-safe, never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pipeline.checks import check_int
from pipeline.errors import InvalidConfigError
from pipeline.request import Request
from stages.scheduler.block_pool import BlockPool, KVCacheBlock

__all__ = ["MAX_UNAPPLIED_STEPS", "ComputedBlocks", "KVCacheManager"]


class ComputedBlocks(NamedTuple):
    """Answer of :meth:`KVCacheManager.get_computed_blocks`: the cached prefix."""

    blocks: list[KVCacheBlock]
    num_computed_tokens: int


MAX_UNAPPLIED_STEPS = 4
"""Steps whose prefix-cache registrations :class:`KVCacheManager` remembers until
their output is applied (async scheduling keeps at most two unapplied)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the blocks of each request.

    Args:
        num_blocks: Blocks in the paged cache.
        block_size: Tokens per block.
        enable_caching: Reuse full blocks across requests through their chained hashes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        check_int("block_size", block_size, InvalidConfigError, lo=1)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Per step not yet applied (oldest first): the blocks each request registered
        # in the prefix cache while that step was planned.
        self._unapplied: dict[int, dict[str, list[tuple[KVCacheBlock, bytes]]]] = {}
        self._step_cached: dict[str, list[tuple[KVCacheBlock, bytes]]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may use (free, cached or not)."""
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix of ``request``'s full blocks found in the prefix cache.

        Never the whole request: at least its last token is left to compute so that the
        step produces logits for it. Does not take references (see
        :meth:`allocate_slots`). Meant for a request that holds no blocks yet.
        """
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_tokens: int = 0,
        *,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``request``'s next tokens; all-or-nothing.

        The table must cover ``request.num_computed_tokens + num_new_computed_tokens +
        num_external_tokens + num_new_tokens`` tokens afterwards.

        Args:
            request: The request; ``num_computed_tokens`` is not changed here.
            num_new_tokens: Tokens to compute this step.
            num_new_computed_tokens: Tokens covered by ``new_computed_blocks``.
            new_computed_blocks: Prefix-cache hits from :meth:`get_computed_blocks`;
                they get a reference and lead the table.
            num_external_tokens: Tokens a connector loads after the local hits.
            delay_cache_blocks: Do not register full blocks yet (an async load fills
                them later; call :meth:`cache_blocks` once it has).

        Returns:
            The newly allocated blocks (possibly empty), or ``None`` when the pool has
            too few free blocks; then nothing changed.
        """
        req_blocks = self._req_blocks.get(request.request_id, [])
        num_tokens = (
            request.num_computed_tokens
            + num_new_computed_tokens
            + num_external_tokens
            + num_new_tokens
        )
        num_needed = _cdiv(num_tokens, self.block_size) - len(req_blocks)
        num_new = max(0, num_needed - len(new_computed_blocks))
        # Touching a free cached hit takes it out of the free queue too.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new + num_revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks = self._req_blocks.setdefault(request.request_id, [])
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Register the request's full blocks up to ``num_computed_tokens`` in the prefix
        cache (those not registered yet); returns the blocks registered now."""
        if not self.enable_caching:
            return []
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id, [])
        start = self._num_cached_blocks.get(req_id, 0)
        end = min(num_computed_tokens // self.block_size, len(blocks), len(request.block_hashes))
        if end <= start:
            return []
        registered = self.block_pool.cache_full_blocks(
            blocks[start:end],
            request.block_hashes[start:end],
            parent_hash=request.block_hashes[start - 1] if start else None,
            token_ids=request.all_token_ids,
            first_token=start * self.block_size,
            lora=request.lora,
        )
        self._num_cached_blocks[req_id] = end
        if registered:
            record = self._step_cached.setdefault(req_id, [])
            record.extend((block, block.block_hash) for block in registered if block.block_hash)
        return registered

    def truncate(self, request: Request, num_valid_tokens: int) -> int:
        """Forget the KV of ``request`` from ``num_valid_tokens`` on (a failed load).

        Blocks from ``num_valid_tokens // block_size`` on leave the prefix cache and
        will be cached again once recomputed; the table itself is kept.

        Returns:
            The number of blocks taken out of the prefix cache.
        """
        req_id = request.request_id
        first = num_valid_tokens // self.block_size
        blocks = self._req_blocks.get(req_id, [])
        if req_id in self._num_cached_blocks:
            self._num_cached_blocks[req_id] = min(self._num_cached_blocks[req_id], first)
        return self.block_pool.uncache(blocks[first:])

    def start_step(self, step_id: int) -> None:
        """Begin planning step ``step_id``: its registrations are recorded apart.

        The records of the most recent :data:`MAX_UNAPPLIED_STEPS` steps whose output
        was not applied are kept (a failed step's never are; the bound drops them).
        """
        self._step_cached = {}
        self._unapplied[step_id] = self._step_cached
        while len(self._unapplied) > MAX_UNAPPLIED_STEPS:
            del self._unapplied[next(iter(self._unapplied))]

    def forget_step(self, step_id: int) -> None:
        """Step ``step_id``'s output was applied: its KV is written, its registrations
        stay for good."""
        self._unapplied.pop(step_id, None)

    def uncache_step_blocks(self, req_id: str) -> int:
        """Take the blocks ``req_id`` registered in the prefix cache in the steps not
        yet applied back out (a step failed: their KV was never written, or is not
        known to be). Call it before freeing the request; it also works after (an
        abort raced the failure). Returns how many entries were removed."""
        removed = 0
        for records in self._unapplied.values():
            for block, block_hash in records.pop(req_id, []):
                if block.block_hash == block_hash:
                    removed += self.block_pool.uncache([block])
        return removed

    def free(self, request: Request) -> None:
        """Release every block of ``request``, tail first so tail blocks are evicted
        first. A request without blocks is a no-op."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def has_blocks(self, req_id: str) -> bool:
        """Whether ``req_id`` holds a block table."""
        return req_id in self._req_blocks

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        """The block table of ``req_id`` (a copy; empty when it holds none)."""
        return list(self._req_blocks.get(req_id, ()))

    def get_block_ids(self, req_id: str) -> list[int]:
        """The block ids of ``req_id``'s table, in order (empty when it holds none)."""
        return [block.block_id for block in self._req_blocks.get(req_id, ())]

    def owners(self) -> dict[str, list[int]]:
        """``{req_id: block_ids}`` of every request holding blocks (for leak checks)."""
        return {req_id: [b.block_id for b in blocks] for req_id, blocks in self._req_blocks.items()}
