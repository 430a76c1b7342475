"""The ``offload`` KV connector: an LRU tier of KV blocks in host memory.

The scheduler half (:class:`OffloadScheduler`) owns the index of what the tier holds and
decides every slot; each rank's worker half (:class:`OffloadWorker`) mirrors it in a
host pool and copies exactly what each step's :class:`OffloadMetadata` says, loading
layer by layer so compute overlaps the transfer. Registered as ``"offload"``::

    EngineConfig(connector="offload", connector_options={"num_blocks": 4096})

Options: see :class:`OffloadOptions`.
"""

from connectors.offload.index import BlockKey, SlotIndex, SlotUsage
from connectors.offload.metadata import BlockCopy, OffloadMetadata
from connectors.offload.options import OFFLOAD_OPTIONS, OffloadOptions
from connectors.offload.pool import CopyRun, HostKVPool, make_runs
from connectors.offload.scheduler import OffloadScheduler
from connectors.offload.state import OffloadWorkerStats
from connectors.offload.transfer import LoadJob, StreamLoader, ThreadLoader
from connectors.offload.worker import OffloadWorker
from connectors.registry import register_connector

__all__ = [
    "OFFLOAD_OPTIONS",
    "BlockCopy",
    "BlockKey",
    "CopyRun",
    "HostKVPool",
    "LoadJob",
    "OffloadMetadata",
    "OffloadOptions",
    "OffloadScheduler",
    "OffloadWorker",
    "OffloadWorkerStats",
    "SlotIndex",
    "SlotUsage",
    "StreamLoader",
    "ThreadLoader",
    "make_runs",
]

register_connector("offload", OffloadScheduler, OffloadWorker)
