"""``OffloadScheduler``: the scheduler half of the offload connector.

It owns the :class:`~connectors.offload.index.SlotIndex` and decides every slot: each
step's :class:`~connectors.offload.metadata.OffloadMetadata` tells every worker which
slots to load into which blocks and which blocks to store into which slots, so the
workers' host pools mirror the index exactly. Per step (all on the event loop, none of
it blocks)::

    schedule():  get_num_new_matched_tokens → update_state_after_alloc   (per admission)
                 build_connector_meta                                   (once)
    update():    request_finished (per finish) → update_connector_output (once)

A save is committed to the index only when its step's output comes back through
``update_connector_output``; a step that failed never calls it, so its saves are
dropped when the next step is built (the engine runs one step at a time).

**KV events** (:meth:`OffloadScheduler.set_kv_event_sink`, only while events are on):
the index reports into a sink of medium ``"CPU"`` (``MEDIUM_CPU``, the medium of vLLM's
CPU offloading tier). A hash is stored when its save is committed (the step's output
came back without a failed save for its request) and removed when the LRU evicts it for
another save or a failed load drops it; a failed save was never announced. Like vLLM's
offloading connector, the tier keeps hashes, not tokens: its ``BlockStored`` events
carry the hashes only (``token_ids`` empty, ``parent_block_hash`` ``None``, the engine's
``block_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from connectors.base import (
    ConnectorContext,
    KVConnectorOutput,
    KVConnectorScheduler,
    MatchResult,
    RequestFinishedResult,
)
from connectors.offload.index import BlockKey, SlotIndex
from connectors.offload.metadata import BlockCopy, OffloadMetadata
from connectors.offload.options import OffloadOptions
from connectors.store.metadata import require_fingerprint
from connectors.store.tracking import (
    RequestTracker,
    cdiv,
    match_candidates,
    new_full_blocks,
    track_scheduled,
    unsaved_at_finish,
)
from pipeline.kv_events.events import MEDIUM_CPU
from pipeline.logger import get_logger

if TYPE_CHECKING:
    from pipeline.artifacts import ScheduledRequest, SchedulerOutput
    from pipeline.kv_events.sink import KVEventSink
    from pipeline.request import Request

__all__ = ["OffloadScheduler"]

log = get_logger()


@attrs.frozen
class _Match:
    """What ``get_num_new_matched_tokens`` found: slots of blocks ``start, start + 1, ...``."""

    start: int
    slots: tuple[int, ...]


@attrs.define
class _BuiltStep:
    """A step whose metadata was built and whose output has not come back yet."""

    pins: list[int] = attrs.Factory(list)  # slots of its loads (within the step)
    load_keys: dict[int, BlockKey] = attrs.Factory(dict)  # block id -> key, its loads
    pending: dict[str, list[BlockKey]] = attrs.Factory(dict)  # its saves, per request
    async_loads: list[BlockCopy] = attrs.Factory(list)  # started in it, across steps


@attrs.define
class _AsyncLoad:
    """A parked request's load: pinned until every rank reports it received."""

    pins: list[int]
    load_keys: dict[int, BlockKey]


class OffloadScheduler(KVConnectorScheduler):
    """Decides what the host-memory tier loads and stores (see the module docstring).

    Args:
        context: ``options`` are validated by :class:`OffloadOptions`; ``fingerprint``
            is required (it is half of every key).
        index: Share an existing index (several schedulers over one store); a new one of
            ``num_blocks`` slots by default.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    def __init__(self, context: ConnectorContext, index: SlotIndex | None = None) -> None:
        super().__init__(context)
        self.options = OffloadOptions.from_options(context.options)
        self.fingerprint_key = require_fingerprint(context, "offload").key()
        self.block_size = context.block_size
        self.index = index if index is not None else SlotIndex(self.options.num_blocks)
        self._trackers: dict[str, RequestTracker] = {}
        #: Full blocks of finished requests never offered for a save (speculative
        #: drafts filled them in the request's last step; see ``unsaved_at_finish``).
        self.num_unsaved_blocks = 0
        self._matches: dict[str, _Match] = {}
        self._loads: list[BlockCopy] = []  # registered since the last build
        self._built: _BuiltStep | None = None
        self._async: dict[str, _AsyncLoad] = {}  # parked request -> its load

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """The longest run of ``request``'s blocks from ``num_computed_tokens`` on that
        the tier holds, in tokens (whole blocks, never the last prompt token).

        Touches the matched entries so they are the last to be evicted. Does not mutate
        the request; never blocks.
        """
        req_id, bs = request.request_id, self.block_size
        self._matches.pop(req_id, None)
        start, hashes = match_candidates(request, num_computed_tokens, bs)
        slots: list[int] = []
        for block_hash in hashes:
            key = (self.fingerprint_key, block_hash)
            slot = self.index.lookup(key)
            if slot is None:
                break
            self.index.touch(key)
            slots.append(slot)
        if not slots:
            return MatchResult(0, False)
        self._matches[req_id] = _Match(start, tuple(slots))
        return MatchResult(len(slots) * bs, self.options.async_load)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Start tracking ``request`` (its whole block table) and pin the slots it loads.

        Called for every admission, including resumption after preemption.
        """
        req_id = request.request_id
        self._trackers[req_id] = RequestTracker(request, list(block_ids))
        match = self._matches.pop(req_id, None)
        if match is None or num_external_tokens <= 0:
            return
        count = min(cdiv(num_external_tokens, self.block_size), len(match.slots))
        loads: list[BlockCopy] = []
        for offset, slot in enumerate(match.slots[:count]):
            index = match.start + offset
            block_hash = request.block_hashes[index]
            if self.index.lookup((self.fingerprint_key, block_hash)) != slot:
                # nothing evicts between the match and the allocation
                raise AssertionError(f"offload slot {slot} of {req_id} changed before its load")
            self.index.pin(slot)
            loads.append(BlockCopy(req_id, block_ids[index], slot, block_hash))
        if self.options.async_load:
            keys = {c.block_id: (self.fingerprint_key, c.block_hash) for c in loads}
            self._async[req_id] = _AsyncLoad([c.slot for c in loads], keys)
        self._loads.extend(loads)

    # ---------------------------------------------------------------------- step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        """This step's loads (registered at admission) and saves (blocks that become
        full in this step and are not stored yet, each given a slot, LRU-evicting)."""
        loads, self._loads = self._loads, []
        if self._built is not None:  # the previous step never came back: it failed
            self._release(self._built, failed=frozenset(self._built.pending))
            # its async loads may never have started: start them again (idempotent)
            loads += [c for c in self._built.async_loads if c.req_id in self._async]
        built = _BuiltStep()
        for copy in loads:
            if copy.req_id in self._async:
                built.async_loads.append(copy)
            else:
                built.pins.append(copy.slot)
                built.load_keys[copy.block_id] = (self.fingerprint_key, copy.block_hash)
        async_ids = {c.req_id for c in built.async_loads}
        saves: list[BlockCopy] = []
        for item in scheduler_output.requests:
            tracker = track_scheduled(self._trackers, item, "offload")
            if tracker is None:
                continue
            self._plan_saves(tracker, item, built, saves)
        self._built = built
        return OffloadMetadata.build(scheduler_output.step_id, loads, saves, async_ids)

    def _plan_saves(
        self,
        tracker: RequestTracker,
        item: ScheduledRequest,
        built: _BuiltStep,
        saves: list[BlockCopy],
    ) -> None:
        """Reserve slots for the blocks of ``item`` that become full in this step."""
        req_id, hashes = item.req_id, tracker.request.block_hashes
        for index in new_full_blocks(tracker, item, self.block_size):
            key = (self.fingerprint_key, hashes[index])
            if key in self.index:
                self.index.touch(key)
                continue
            slot = self.index.reserve(key)
            if slot is None:  # every slot is pending or being loaded: skip, not an error
                log.debug("offload tier full this step", req_id=req_id, block=index)
                return
            built.pending.setdefault(req_id, []).append(key)
            saves.append(BlockCopy(req_id, tracker.block_ids[index], slot, hashes[index]))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Commit the step's saves (failed ones free their slots), unpin its loads, drop
        entries whose load failed, and unpin async loads that completed."""
        built, self._built = self._built, None
        sources = [built.load_keys] if built is not None else []
        sources += [load.load_keys for load in self._async.values()]
        for block_id in output.invalid_block_ids:
            for keys in sources:
                key = keys.pop(block_id, None)
                if key is not None:
                    log.warning("offload: dropping a slot that failed to load", block_id=block_id)
                    self.index.discard(key)
        if built is not None:
            self._release(built, failed=output.failed_save_req_ids)
        for req_id in output.finished_recving:
            self._unpin_async(req_id)

    def _unpin_async(self, req_id: str) -> None:
        load = self._async.pop(req_id, None)
        for slot in load.pins if load is not None else ():
            self.index.unpin(slot)

    def _release(self, built: _BuiltStep, failed: frozenset[str]) -> None:
        for slot in built.pins:
            self.index.unpin(slot)
        for req_id, keys in built.pending.items():
            for key in keys:
                if req_id in failed:
                    self.index.abort(key)
                else:
                    self.index.commit(key)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """Stop tracking ``request``; its saves of this step still commit. An async load
        still in flight is unpinned: each worker cancels it before its next forward."""
        req_id = request.request_id
        tracker = self._trackers.pop(req_id, None)
        self.num_unsaved_blocks += unsaved_at_finish(tracker, self.block_size, "offload")
        self._matches.pop(req_id, None)
        self._unpin_async(req_id)
        return RequestFinishedResult()

    def set_kv_event_sink(self, sink: KVEventSink) -> None:
        """Report the hashes the tier commits and evicts into ``sink``, as medium
        ``"CPU"`` (see the module docstring). An index shared by several schedulers
        reports into the sink of the last one given."""
        self.index.kv_events = sink.for_medium(MEDIUM_CPU)

    def has_pending_work(self) -> bool:
        """Whether async loads are still in flight."""
        return bool(self._async)

    @property
    def num_tracked_requests(self) -> int:
        """Requests being tracked (0 once every request finished)."""
        return len(self._trackers)
