"""``RedisMetadata``: one step's loads and saves, decided by the scheduler half.

Plain parallel tuples (str, int, bytes) so msgspec encodes it without pickle.
"""

from __future__ import annotations

import attrs

from connectors.store.metadata import BlockRef, StoreMetadata

__all__ = ["BlockTransfer", "RedisMetadata"]

BlockTransfer = BlockRef
"""One block moved between the paged cache and the store (the name redis code uses)."""


@attrs.frozen(kw_only=True)
class RedisMetadata(StoreMetadata):
    """The loads and saves of one step (parallel tuples, one entry per block; see
    :class:`StoreMetadata`): loads are read from the server, saves are blocks that
    become full in this step and are not known to be stored."""
