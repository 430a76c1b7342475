"""The ``shared_storage`` connector: KV blocks in a directory shared across engines.

One framed safetensors value per block (:mod:`connectors.framing`) at
``path / <fingerprint key> / <hash hex[:2]> / <hash hex>.kv`` (every file name:
:mod:`connectors.shared_storage.naming`), written atomically, verified on every read,
private to its user by default. Options: ``path`` (required), ``max_bytes``,
``load_timeout_s``, ``stale_temp_s``, ``allow_shared``, ``hmac_key_env`` (see
:class:`SharedStorageOptions`, which also says why ``hash_seed`` should be secret).
KV events: medium ``"DISK"`` (:data:`MEDIUM_DISK`; :mod:`connectors.shared_storage.scheduler`).
"""

from __future__ import annotations

from connectors.registry import register_connector
from connectors.shared_storage import naming
from connectors.shared_storage.metadata import BlockRef, SharedStorageMetadata
from connectors.shared_storage.options import SHARED_STORAGE_OPTIONS, SharedStorageOptions
from connectors.shared_storage.scheduler import MEDIUM_DISK, SharedStorageScheduler
from connectors.shared_storage.store import DiskStore, write_atomic
from connectors.shared_storage.worker import SharedStorageWorker, SharedStorageWorkerStats

__all__ = [
    "MEDIUM_DISK",
    "SHARED_STORAGE_OPTIONS",
    "BlockRef",
    "DiskStore",
    "SharedStorageMetadata",
    "SharedStorageOptions",
    "SharedStorageScheduler",
    "SharedStorageWorker",
    "SharedStorageWorkerStats",
    "naming",
    "write_atomic",
]

register_connector("shared_storage", SharedStorageScheduler, SharedStorageWorker)
