"""``SharedStorageMetadata``: one step's block loads and saves (parallel plain tuples)."""

from __future__ import annotations

import attrs

from connectors.store.metadata import BlockRef, StoreMetadata

__all__ = ["BlockRef", "SharedStorageMetadata"]


@attrs.frozen(kw_only=True)
class SharedStorageMetadata(StoreMetadata):
    """The loads and saves of one step, one entry per block (:class:`StoreMetadata`):
    loads read store → block, saves write block → store (blocks that become full in this
    step and that the store did not hold when it was built)."""
