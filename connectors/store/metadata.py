"""``StoreMetadata``: one step's block loads and saves of a store connector.

Plain parallel tuples (str, int, bytes) so msgspec encodes it without pickle. Each store
connector (``shared_storage``, ``redis``) subclasses it under its own name.
"""

from __future__ import annotations

from typing import NamedTuple, Self

import attrs

from connectors.base import ConnectorContext, KVConnectorMetadata, ModelFingerprint
from pipeline.errors import InvalidConfigError

__all__ = ["BlockRef", "StoreMetadata", "require_fingerprint"]


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


def require_fingerprint(context: ConnectorContext, connector: str) -> ModelFingerprint:
    """``context.fingerprint``: every stored block is keyed by the model.

    Raises:
        InvalidConfigError: ``context`` has no fingerprint.
    """
    if context.fingerprint is None:
        raise InvalidConfigError(
            "ConnectorContext.fingerprint", None, f"{connector} keys every block by the model"
        )
    return context.fingerprint


def _check(inst: StoreMetadata, prefix: str) -> None:
    lengths = {len(getattr(inst, f"{prefix}_{f}")) for f in ("req_ids", "block_ids", "hashes")}
    if len(lengths) > 1:  # built by a StoreScheduler only: an internal invariant
        name = type(inst).__name__
        raise AssertionError(f"{name} {prefix} fields differ in length: {lengths}")


@attrs.frozen(kw_only=True)
class StoreMetadata(KVConnectorMetadata):
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
    def build(cls, step_id: int, loads: list[BlockRef], saves: list[BlockRef]) -> Self:
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
        fields = zip(self.load_req_ids, self.load_block_ids, self.load_hashes, strict=True)
        return [BlockRef(*f) for f in fields]

    def saves(self) -> list[BlockRef]:
        """The saves, one :class:`BlockRef` per block."""
        fields = zip(self.save_req_ids, self.save_block_ids, self.save_hashes, strict=True)
        return [BlockRef(*f) for f in fields]
