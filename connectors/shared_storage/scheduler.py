"""``SharedStorageScheduler``: the scheduler half of the shared_storage connector.

A shared store is shared across engines and restarts, so this half keeps no index: it
asks the directory. A block matches when its value exists for **every** rank's
fingerprint (each rank loads its own shard of the KV; a block missing for one rank would
be a load error on that rank anyway). Existence is not validity: a value found corrupt
at load time is a load error, and the engine recomputes (or fails the request under
``load_failure_policy="fail"``). The per-step flow is :class:`StoreScheduler`'s; this
half only probes (``stat`` calls, no reads of values) and skips saves already stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from connectors.base import ConnectorContext
from connectors.shared_storage.metadata import BlockRef, SharedStorageMetadata
from connectors.shared_storage.options import SharedStorageOptions
from connectors.shared_storage.store import DiskStore
from connectors.store.metadata import StoreMetadata
from connectors.store.scheduler import StoreScheduler

__all__ = ["SharedStorageScheduler"]


class SharedStorageScheduler(StoreScheduler):
    """Decides what each step loads from and saves to the store (module docstring).

    Raises:
        InvalidConfigError: Bad options, an unusable path, or no fingerprint.
    """

    name: ClassVar[str] = "shared_storage"
    metadata_type: ClassVar[type[StoreMetadata]] = SharedStorageMetadata

    def __init__(self, context: ConnectorContext) -> None:
        options = SharedStorageOptions.from_options(context.options)  # before the fingerprint
        super().__init__(context)
        self.options = options
        self.store = DiskStore(self.options.path, allow_shared=self.options.allow_shared)
        self._loaded: set[bytes] = set()  # hashes loaded in the step being built
        self._seen: set[bytes] = set()  # hashes saved in the step being built

    def _stored(self, block_hash: bytes) -> bool:
        return all(self.store.contains(key, block_hash) for key in self.fingerprint_keys)

    def probe(self, hashes: tuple[bytes, ...]) -> Sequence[bool]:
        """``stat`` each block for every rank, stopping at the first miss (blocking)."""
        found = [False] * len(hashes)
        for n, block_hash in enumerate(hashes):
            if not self._stored(block_hash):
                break
            found[n] = True
        return found

    def begin_build(self, loads: list[BlockRef]) -> None:
        """Forget the previous step's hashes; remember this step's loads."""
        self._loaded = {ref.block_hash for ref in loads}
        self._seen = set()

    def wants_save(self, req_id: str, block_hash: bytes) -> bool:
        """One save per hash, none of a hash loaded or stored for every rank."""
        if block_hash in self._seen or block_hash in self._loaded or self._stored(block_hash):
            return False
        self._seen.add(block_hash)
        return True
