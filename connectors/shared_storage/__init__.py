"""The ``shared_storage`` connector: KV blocks in a directory shared across engines.

One framed safetensors value per block (:mod:`connectors.framing`) at
``path / <fingerprint key> / <hash hex[:2]> / <hash hex>.kv``, written atomically,
verified on every read. Options: ``path`` (required), ``max_bytes``, ``load_timeout_s``,
``stale_temp_s`` (see :class:`SharedStorageOptions`).
"""

from __future__ import annotations

from connectors.registry import register_connector
from connectors.shared_storage.metadata import BlockRef, SharedStorageMetadata
from connectors.shared_storage.options import SHARED_STORAGE_OPTIONS, SharedStorageOptions
from connectors.shared_storage.scheduler import SharedStorageScheduler
from connectors.shared_storage.store import DiskStore, write_atomic
from connectors.shared_storage.worker import SharedStorageWorker, SharedStorageWorkerStats

__all__ = [
    "SHARED_STORAGE_OPTIONS",
    "BlockRef",
    "DiskStore",
    "SharedStorageMetadata",
    "SharedStorageOptions",
    "SharedStorageScheduler",
    "SharedStorageWorker",
    "SharedStorageWorkerStats",
    "write_atomic",
]

register_connector("shared_storage", SharedStorageScheduler, SharedStorageWorker)
