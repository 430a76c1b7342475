"""``SharedStorageScheduler``: the scheduler half of the shared_storage connector.

A shared store is shared across engines and restarts, so this half keeps no index: it
asks the directory. A block matches when its value exists for **every** rank's
fingerprint (each rank loads its own shard of the KV; a block missing for one rank would
be a load error on that rank anyway). Existence is not validity: a value found corrupt
at load time is a load error, and the engine recomputes (or fails the request under
``load_failure_policy="fail"``).

Per step, on the event loop (``stat`` calls only; no reads of values)::

    schedule():  get_num_new_matched_tokens → update_state_after_alloc   (per admission)
                 build_connector_meta                                   (once)
    update():    request_finished (per finish) → update_connector_output (once)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from connectors.base import (
    ConnectorContext,
    KVConnectorScheduler,
    MatchResult,
    RequestFinishedResult,
)
from connectors.shared_storage.metadata import BlockRef, SharedStorageMetadata
from connectors.shared_storage.options import SharedStorageOptions
from connectors.shared_storage.store import DiskStore
from pipeline.errors import InvalidConfigError
from pipeline.logs import get_logger

if TYPE_CHECKING:
    from pipeline.artifacts import SchedulerOutput
    from pipeline.request import Request

__all__ = ["SharedStorageScheduler"]

log = get_logger()


@attrs.define
class _Tracker:
    """A request's block table as the workers have it, and the live request (hashes)."""

    request: Request
    block_ids: list[int]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SharedStorageScheduler(KVConnectorScheduler):
    """Decides what each step loads from and saves to the store (module docstring).

    Raises:
        InvalidConfigError: Bad options, an unusable path, or no fingerprint.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = SharedStorageOptions.from_options(context.options)
        fp = context.fingerprint
        if fp is None:
            raise InvalidConfigError(
                "ConnectorContext.fingerprint", None, "shared_storage keys blocks by the model"
            )
        self.store = DiskStore(self.options.path)
        self.block_size = context.block_size
        size = max(fp.tp_size, context.world_size)
        self.rank_keys = tuple(attrs.evolve(fp, tp_rank=r).key() for r in range(size))
        self._trackers: dict[str, _Tracker] = {}
        self._matches: dict[str, int] = {}  # request -> first matched block index
        self._loads: list[BlockRef] = []

    def _stored(self, block_hash: bytes) -> bool:
        return all(self.store.contains(key, block_hash) for key in self.rank_keys)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """The longest run of ``request``'s blocks from ``num_computed_tokens`` that the
        store holds for every rank, in tokens (whole blocks, never the last prompt token).

        Blocks on ``stat`` calls (one per block and rank). Loads complete in the step.
        """
        req_id, bs = request.request_id, self.block_size
        self._matches.pop(req_id, None)
        if num_computed_tokens % bs:
            return MatchResult(0, False)
        start = num_computed_tokens // bs
        stop = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        count = 0
        for block_hash in request.block_hashes[start:stop]:
            if not self._stored(block_hash):
                break
            count += 1
        if not count:
            return MatchResult(0, False)
        self._matches[req_id] = start
        return MatchResult(count * bs, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Track ``request``'s block table; register the loads of its matched blocks."""
        req_id = request.request_id
        self._trackers[req_id] = _Tracker(request, list(block_ids))
        start = self._matches.pop(req_id, None)
        if start is None or num_external_tokens <= 0:
            return
        count = _cdiv(num_external_tokens, self.block_size)
        for index in range(start, start + count):
            block_hash = request.block_hashes[index]
            self._loads.append(BlockRef(req_id, block_ids[index], block_hash))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        """This step's loads (registered at admission) and saves: blocks that become
        full in this step, not stored yet for every rank, one save per hash."""
        loads, self._loads = self._loads, []
        loaded = {ref.block_hash for ref in loads}
        saves: list[BlockRef] = []
        seen: set[bytes] = set()
        bs = self.block_size
        for item in scheduler_output.requests:
            tracker = self._trackers.get(item.req_id)
            if tracker is None:
                log.debug("shared_storage: request without a tracker", req_id=item.req_id)
                continue
            if item.new:
                tracker.block_ids = list(item.block_ids)
            else:
                tracker.block_ids.extend(item.block_ids)
            hashes = tracker.request.block_hashes
            end = item.num_computed_tokens + len(item.token_ids)
            stop = min(end // bs, len(tracker.block_ids), len(hashes))
            for index in range(item.num_computed_tokens // bs, stop):
                block_hash = hashes[index]
                if block_hash in seen or block_hash in loaded or self._stored(block_hash):
                    continue
                seen.add(block_hash)
                saves.append(BlockRef(item.req_id, tracker.block_ids[index], block_hash))
        return SharedStorageMetadata.build(scheduler_output.step_id, loads, saves)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """Stop tracking ``request``; this step's saves of it are already written."""
        self._trackers.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        return RequestFinishedResult()

    @property
    def num_tracked_requests(self) -> int:
        """Requests being tracked (0 once every request finished)."""
        return len(self._trackers)
