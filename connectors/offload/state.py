"""The worker half's bookkeeping: totals since start and the state of one step."""

from __future__ import annotations

import attrs

from connectors.offload.metadata import BlockCopy
from connectors.offload.pool import CopyRun
from connectors.store.worker import StoreWorkerStats
from pipeline.device_sync import DeviceEvent

__all__ = ["OffloadWorkerStats", "StepState"]


@attrs.frozen(kw_only=True)
class OffloadWorkerStats(StoreWorkerStats):
    """Blocks moved by one rank since it started (``OffloadWorker.stats``)."""


@attrs.define
class StepState:
    """One step's state of a worker; written on the event loop before the forward
    thread reads it (``save_failed`` is also written by the forward thread, under the
    worker's lock)."""

    saves: list[BlockCopy] = attrs.Factory(list)
    save_runs: list[CopyRun] = attrs.Factory(list)
    save_failed: set[str] = attrs.Factory(set)
    save_events: list[DeviceEvent] = attrs.Factory(list)
    load_req: dict[int, str] = attrs.Factory(dict)  # block id -> request (sync loads)
    load_errors: set[int] = attrs.Factory(set)
    loaded_blocks: int = 0
    saved_blocks: int = 0
