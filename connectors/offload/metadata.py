"""``OffloadMetadata``: one step's slot ↔ block copies, decided by the scheduler half.

Plain parallel tuples (ints, bytes, str) so msgspec encodes it without pickle. The
worker half never decides a slot: it copies exactly what the metadata says, which keeps
every rank's host pool an exact mirror of the scheduler's index.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from connectors.base import KVConnectorMetadata

__all__ = ["BlockCopy", "OffloadMetadata"]


class BlockCopy(NamedTuple):
    """One block moved between the paged cache and the host pool.

    Attributes:
        req_id: The request the block belongs to.
        block_id: The block in the paged cache.
        slot: The slot in the host pool.
        block_hash: The block's chained hash (with the rank's fingerprint, its key).
    """

    req_id: str
    block_id: int
    slot: int
    block_hash: bytes


def _same_length(inst: OffloadMetadata, prefix: str) -> None:
    fields = [getattr(inst, f"{prefix}_{name}") for name in ("req_ids", "block_ids", "slots")]
    lengths = {len(f) for f in [*fields, getattr(inst, f"{prefix}_hashes")]}
    if len(lengths) > 1:  # built by OffloadScheduler only: an internal invariant
        raise AssertionError(f"OffloadMetadata {prefix} fields differ in length: {lengths}")


@attrs.frozen(kw_only=True)
class OffloadMetadata(KVConnectorMetadata):
    """The loads and saves of one step (parallel tuples, one entry per block).

    Attributes:
        step_id: The step it was built for.
        load_req_ids / load_block_ids / load_slots / load_hashes: copy slot → block.
        async_req_ids: Requests whose loads complete across steps (reported through
            ``get_finished(...).recving``); the other loads complete within the step.
        save_req_ids / save_block_ids / save_slots / save_hashes: copy block → slot
            (blocks that become full in this step and are not in the tier yet).
    """

    step_id: int
    load_req_ids: tuple[str, ...] = ()
    load_block_ids: tuple[int, ...] = ()
    load_slots: tuple[int, ...] = ()
    load_hashes: tuple[bytes, ...] = ()
    async_req_ids: tuple[str, ...] = ()
    save_req_ids: tuple[str, ...] = ()
    save_block_ids: tuple[int, ...] = ()
    save_slots: tuple[int, ...] = ()
    save_hashes: tuple[bytes, ...] = ()

    def __attrs_post_init__(self) -> None:
        _same_length(self, "load")
        _same_length(self, "save")

    @classmethod
    def build(
        cls, step_id: int, loads: list[BlockCopy], saves: list[BlockCopy], async_req_ids: set[str]
    ) -> OffloadMetadata:
        """Pack lists of copies into the parallel tuples."""
        return cls(
            step_id=step_id,
            load_req_ids=tuple(c.req_id for c in loads),
            load_block_ids=tuple(c.block_id for c in loads),
            load_slots=tuple(c.slot for c in loads),
            load_hashes=tuple(c.block_hash for c in loads),
            async_req_ids=tuple(sorted(async_req_ids)),
            save_req_ids=tuple(c.req_id for c in saves),
            save_block_ids=tuple(c.block_id for c in saves),
            save_slots=tuple(c.slot for c in saves),
            save_hashes=tuple(c.block_hash for c in saves),
        )

    def loads(self) -> list[BlockCopy]:
        """The loads, one :class:`BlockCopy` per block."""
        return [
            BlockCopy(*fields)
            for fields in zip(
                self.load_req_ids,
                self.load_block_ids,
                self.load_slots,
                self.load_hashes,
                strict=True,
            )
        ]

    def saves(self) -> list[BlockCopy]:
        """The saves, one :class:`BlockCopy` per block."""
        return [
            BlockCopy(*fields)
            for fields in zip(
                self.save_req_ids,
                self.save_block_ids,
                self.save_slots,
                self.save_hashes,
                strict=True,
            )
        ]
