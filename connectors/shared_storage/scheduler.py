"""``SharedStorageScheduler``: the scheduler half of the shared_storage connector.

A shared store is shared across engines and restarts, so this half keeps no index: it
asks the directory. A block matches when its value exists for **every** rank's
fingerprint (each rank loads its own shard of the KV; a block missing for one rank would
be a load error on that rank anyway). Existence is not validity: a value found corrupt
at load time is a load error, and the engine recomputes (or fails the request under
``load_failure_policy="fail"``). The per-step flow is :class:`StoreScheduler`'s; this
half probes (``stat`` calls, no reads of values), skips saves already stored, and
enforces ``max_bytes``: once a step's saves landed, it evicts the least recently
accessed values of the whole store (one evictor per engine, not one per rank; the tree
is scanned only when the running size estimate is over the cap).

**KV events**: medium ``"DISK"`` (:data:`MEDIUM_DISK`; see
:class:`~connectors.store.events.StoreEvents` for what is reported). Besides the common
events, a value of this engine's fingerprint (any rank) that its own eviction removed
is removed, and a save the store turns out to hold already (``stat`` before saving) is
stored, one found missing although announced is removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from connectors.base import ConnectorContext
from connectors.shared_storage.metadata import BlockRef, SharedStorageMetadata
from connectors.shared_storage.naming import SUFFIX
from connectors.shared_storage.options import SharedStorageOptions
from connectors.shared_storage.store import DiskStore
from connectors.store.metadata import StoreMetadata
from connectors.store.scheduler import StoreScheduler
from pipeline.kv_events.events import MEDIUM_DISK

__all__ = ["MEDIUM_DISK", "SharedStorageScheduler"]


class SharedStorageScheduler(StoreScheduler):
    """Decides what each step loads from and saves to the store (module docstring).

    Raises:
        InvalidConfigError: Bad options, an unusable path, or no fingerprint.
    """

    name: ClassVar[str] = "shared_storage"
    medium: ClassVar[str] = MEDIUM_DISK
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
        if block_hash in self._seen or block_hash in self._loaded:
            return False
        stored = self._stored(block_hash)
        if self.kv_events is not None:
            self.kv_events.probed((block_hash,), (stored,))
        if stored:
            return False
        self._seen.add(block_hash)
        return True

    def settle(self, landed: list[bytes], lost: list[bytes]) -> None:
        """Count the landed values in the size estimate and evict past ``max_bytes``
        (blocking: ``stat`` per landed value and rank; a tree scan when over the cap)."""
        max_bytes = self.options.max_bytes
        if max_bytes is None or not landed:
            return
        for block_hash in landed:
            for key in self.fingerprint_keys:
                self.store.added(key, block_hash)
        removed: list[Path] = []
        self.store.evict(max_bytes, removed)
        if self.kv_events is not None and removed:
            keys = set(self.fingerprint_keys)
            ours = [p for p in removed if p.parent.parent.name in keys]
            self.kv_events.removed(bytes.fromhex(p.name.removesuffix(SUFFIX)) for p in ours)
