"""``SharedStorageMetadata``: one step's block loads and saves (parallel plain tuples)."""

from __future__ import annotations

from typing import NamedTuple

import attrs

from connectors.base import KVConnectorMetadata

__all__ = ["BlockRef", "SharedStorageMetadata"]


class BlockRef(NamedTuple):
    """One block moved between the paged cache and the store.

    Attributes:
        req_id: The request the block belongs to.
        block_id: The block in the paged cache.
        block_hash: The block's chained hash (with the rank's fingerprint, its key).
    """

    req_id: str
    block_id: int
    block_hash: bytes


def _check(inst: SharedStorageMetadata, prefix: str) -> None:
    names = ("req_ids", "block_ids", "hashes")
    lengths = {len(getattr(inst, f"{prefix}_{name}")) for name in names}
    if len(lengths) > 1:  # built by SharedStorageScheduler only: an internal invariant
        raise AssertionError(f"SharedStorageMetadata {prefix} fields differ: {lengths}")


@attrs.frozen(kw_only=True)
class SharedStorageMetadata(KVConnectorMetadata):
    """The loads and saves of one step, one entry per block.

    Attributes:
        step_id: The step it was built for.
        load_req_ids / load_block_ids / load_hashes: read store → block.
        save_req_ids / save_block_ids / save_hashes: write block → store (blocks that
            become full in this step and that the store did not hold when it was built).
    """

    step_id: int
    load_req_ids: tuple[str, ...] = ()
    load_block_ids: tuple[int, ...] = ()
    load_hashes: tuple[bytes, ...] = ()
    save_req_ids: tuple[str, ...] = ()
    save_block_ids: tuple[int, ...] = ()
    save_hashes: tuple[bytes, ...] = ()

    def __attrs_post_init__(self) -> None:
        _check(self, "load")
        _check(self, "save")

    @classmethod
    def build(
        cls, step_id: int, loads: list[BlockRef], saves: list[BlockRef]
    ) -> SharedStorageMetadata:
        """Pack lists of blocks into the parallel tuples."""
        return cls(
            step_id=step_id,
            load_req_ids=tuple(b.req_id for b in loads),
            load_block_ids=tuple(b.block_id for b in loads),
            load_hashes=tuple(b.block_hash for b in loads),
            save_req_ids=tuple(b.req_id for b in saves),
            save_block_ids=tuple(b.block_id for b in saves),
            save_hashes=tuple(b.block_hash for b in saves),
        )

    def loads(self) -> list[BlockRef]:
        """The loads, one :class:`BlockRef` per block."""
        fields = (self.load_req_ids, self.load_block_ids, self.load_hashes)
        return [BlockRef(*f) for f in zip(*fields, strict=True)]

    def saves(self) -> list[BlockRef]:
        """The saves, one :class:`BlockRef` per block."""
        fields = (self.save_req_ids, self.save_block_ids, self.save_hashes)
        return [BlockRef(*f) for f in zip(*fields, strict=True)]
