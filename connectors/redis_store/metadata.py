"""``RedisMetadata``: one step's loads and saves, decided by the scheduler half.

Plain parallel tuples (str, int, bytes) so msgspec encodes it without pickle.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from connectors.base import KVConnectorMetadata

__all__ = ["BlockTransfer", "RedisMetadata"]


class BlockTransfer(NamedTuple):
    """One block moved between the paged cache and the store.

    Attributes:
        req_id: The request the block belongs to.
        block_id: The block in the paged cache.
        block_hash: The block's chained hash (with the rank's fingerprint, its key).
    """

    req_id: str
    block_id: int
    block_hash: bytes


def _check(inst: RedisMetadata, prefix: str) -> None:
    lengths = {len(getattr(inst, f"{prefix}_{f}")) for f in ("req_ids", "block_ids", "hashes")}
    if len(lengths) > 1:  # built by RedisScheduler only: an internal invariant
        raise AssertionError(f"RedisMetadata {prefix} fields differ in length: {lengths}")


@attrs.frozen(kw_only=True)
class RedisMetadata(KVConnectorMetadata):
    """The loads and saves of one step (parallel tuples, one entry per block).

    Attributes:
        step_id: The step it was built for.
        load_req_ids / load_block_ids / load_hashes: blocks to read from the store.
        save_req_ids / save_block_ids / save_hashes: blocks that become full in this
            step and are not known to be stored; written after the forward pass.
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
        cls, step_id: int, loads: list[BlockTransfer], saves: list[BlockTransfer]
    ) -> RedisMetadata:
        """Pack lists of transfers into the parallel tuples."""
        return cls(
            step_id=step_id,
            load_req_ids=tuple(t.req_id for t in loads),
            load_block_ids=tuple(t.block_id for t in loads),
            load_hashes=tuple(t.block_hash for t in loads),
            save_req_ids=tuple(t.req_id for t in saves),
            save_block_ids=tuple(t.block_id for t in saves),
            save_hashes=tuple(t.block_hash for t in saves),
        )

    def loads(self) -> list[BlockTransfer]:
        """The loads, one :class:`BlockTransfer` per block."""
        fields = zip(self.load_req_ids, self.load_block_ids, self.load_hashes, strict=True)
        return [BlockTransfer(*f) for f in fields]

    def saves(self) -> list[BlockTransfer]:
        """The saves, one :class:`BlockTransfer` per block."""
        fields = zip(self.save_req_ids, self.save_block_ids, self.save_hashes, strict=True)
        return [BlockTransfer(*f) for f in fields]
