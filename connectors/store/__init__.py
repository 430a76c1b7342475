"""What the store connectors (``shared_storage``, ``redis``) share, and the per-request
block tracking they share with ``offload``.

A store connector subclasses :class:`StoreScheduler` (it answers ``probe``: which block
hashes the store holds for every rank), :class:`StoreWorker` (paged cache, per-layer
gather of saved blocks, stats) and :class:`StoreMetadata`, and keeps only its store and
its options. :class:`StoreEvents` is what their tiers publish while KV events are on.
"""

from connectors.store.events import StoreEvents
from connectors.store.metadata import BlockRef, StoreMetadata
from connectors.store.scheduler import StoreScheduler
from connectors.store.tracking import RequestTracker
from connectors.store.worker import StoreStep, StoreWorker, StoreWorkerStats

__all__ = [
    "BlockRef",
    "RequestTracker",
    "StoreEvents",
    "StoreMetadata",
    "StoreScheduler",
    "StoreStep",
    "StoreWorker",
    "StoreWorkerStats",
]
