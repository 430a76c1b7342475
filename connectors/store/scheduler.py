"""``StoreScheduler``: the scheduler half shared by the store connectors.

A store (a directory, a Redis server) is shared across engines and restarts, so this
half keeps no authoritative index: a subclass answers :meth:`StoreScheduler.probe` (which
of these block hashes does the store hold for **every** rank) and
:meth:`StoreScheduler.wants_save`; the rest is common. Per step, on the event loop::

    schedule():  get_num_new_matched_tokens → update_state_after_alloc   (per admission)
                 build_connector_meta                                   (once)
    update():    request_finished (per finish) → update_connector_output (once)

Each build records the step's saves (per request) and loads (per block); the step's
output says which saves landed (no rank reported its request's save failed) and which
loads failed, and :meth:`StoreScheduler.settle` hands both to the subclass. A step that
failed never calls ``update_connector_output``: its record is dropped at the next build.

**KV events** (:meth:`StoreScheduler.set_kv_event_sink`, only while events are on): the
tier publishes under its :attr:`~StoreScheduler.medium` what this engine knows the store
holds (:class:`~connectors.store.events.StoreEvents`: landed saves and probe hits are
stored; its own evictions, probe misses and failed loads found missing are removed).
Hashes are the engine's chained block hashes (those the device tier publishes); with
tensor parallelism a block counts only once every rank's value is there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

from connectors.base import (
    ConnectorContext,
    KVConnectorOutput,
    KVConnectorScheduler,
    MatchResult,
    ModelFingerprint,
    RequestFinishedResult,
)
from connectors.store.events import StoreEvents
from connectors.store.metadata import BlockRef, StoreMetadata, require_fingerprint
from connectors.store.tracking import (
    RequestTracker,
    cdiv,
    leading_run,
    match_candidates,
    new_full_blocks,
    track_scheduled,
    unsaved_at_finish,
)

if TYPE_CHECKING:
    from pipeline.artifacts import SchedulerOutput
    from pipeline.kv_events.sink import KVEventSink
    from pipeline.request import Request

__all__ = ["StoreScheduler"]


@attrs.define
class _BuiltStep:
    """A step whose metadata was built and whose output has not come back yet."""

    load_hashes: dict[int, bytes] = attrs.Factory(dict)  # block id -> hash, its loads
    pending: dict[str, list[bytes]] = attrs.Factory(dict)  # its saves, per request


class StoreScheduler(KVConnectorScheduler):
    """Plans each step's loads and saves against a store (see the module docstring).

    Subclasses set ``name``, ``medium`` and ``metadata_type`` and implement
    :meth:`probe`; they may override :meth:`begin_build`, :meth:`wants_save` and
    :meth:`settle`. Every method runs on the event loop thread; only :meth:`probe` (and
    what a subclass's :meth:`settle` does) may do I/O.

    Attributes:
        kv_events: The tier's announced hashes and sink while KV events are on, else
            ``None`` (then no event is made).

    Raises:
        InvalidConfigError: No fingerprint in ``context`` (blocks are keyed by the model).
    """

    name: ClassVar[str] = "store"
    medium: ClassVar[str] = "STORE"
    metadata_type: ClassVar[type[StoreMetadata]] = StoreMetadata

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.fingerprint: ModelFingerprint = require_fingerprint(context, self.name)
        ranks = range(max(context.world_size, self.fingerprint.tp_size))
        # every rank's key: each rank stores its own shard of every block
        self.fingerprint_keys = tuple(
            attrs.evolve(self.fingerprint, tp_rank=r, tp_size=len(ranks)).key() for r in ranks
        )
        self.block_size = context.block_size
        self.kv_events: StoreEvents | None = None
        self._trackers: dict[str, RequestTracker] = {}
        #: Full blocks of finished requests never offered for a save (speculative
        #: drafts filled them in the request's last step; see ``unsaved_at_finish``).
        self.num_unsaved_blocks = 0
        self._matches: dict[str, tuple[int, int]] = {}  # request -> (first block, count)
        self._loads: list[BlockRef] = []  # registered since the last build
        self._built: _BuiltStep | None = None

    # ---------------------------------------------------------------- subclass hooks

    def probe(self, hashes: tuple[bytes, ...]) -> Sequence[bool]:
        """Whether the store holds each of ``hashes`` for every rank, in order. Only the
        leading run of ``True`` counts: a probe may stop at the first miss and report
        the rest ``False``. Must not raise for a store error: report it with fewer
        entries (none), so that nothing past them reads as a miss."""
        raise NotImplementedError

    def begin_build(self, loads: list[BlockRef]) -> None:
        """Called by :meth:`build_connector_meta` with the step's loads, before any
        :meth:`wants_save`. Does nothing by default."""

    def wants_save(self, req_id: str, block_hash: bytes) -> bool:
        """Whether the step saves ``block_hash``, a block of ``req_id`` that became
        full in it. Always by default."""
        return True

    def settle(self, landed: list[bytes], lost: list[bytes]) -> None:
        """A step's output came back: the saves of ``landed`` are in the store for every
        rank, the loads of ``lost`` failed. Called from :meth:`update_connector_output`
        after ``landed`` was announced; does nothing by default."""

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """The longest run of ``request``'s blocks from ``num_computed_tokens`` on that
        the store holds for every rank, in tokens (whole blocks, never the last prompt
        token). Blocks as long as :meth:`probe`; loads complete within their step."""
        req_id = request.request_id
        self._matches.pop(req_id, None)
        start, hashes = match_candidates(request, num_computed_tokens, self.block_size)
        if not hashes:
            return MatchResult(0, False)
        found = self.probe(hashes)
        if self.kv_events is not None:
            self.kv_events.probed(hashes, found)
        count = leading_run(found)
        if not count:
            return MatchResult(0, False)
        self._matches[req_id] = (start, count)
        return MatchResult(count * self.block_size, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Start tracking ``request`` and register the loads of its matched blocks."""
        req_id = request.request_id
        self._trackers[req_id] = RequestTracker(request, list(block_ids))
        match = self._matches.pop(req_id, None)
        if match is None or num_external_tokens <= 0:
            return
        start, matched = match
        count = min(cdiv(num_external_tokens, self.block_size), matched)
        for index in range(start, start + count):
            self._loads.append(BlockRef(req_id, block_ids[index], request.block_hashes[index]))

    # ---------------------------------------------------------------------- step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        """This step's loads (registered at admission) and saves: blocks that become
        full in this step and that :meth:`wants_save`. Blocks only if a hook does.
        The previous step's record, if its output never came back, is dropped: its
        saves are never announced."""
        loads, self._loads = self._loads, []
        self.begin_build(loads)
        built = _BuiltStep(load_hashes={ref.block_id: ref.block_hash for ref in loads})
        saves: list[BlockRef] = []
        for item in scheduler_output.requests:
            tracker = track_scheduled(self._trackers, item, self.name)
            if tracker is None:
                continue
            hashes = tracker.request.block_hashes
            for index in new_full_blocks(tracker, item, self.block_size):
                if self.wants_save(item.req_id, hashes[index]):
                    saves.append(BlockRef(item.req_id, tracker.block_ids[index], hashes[index]))
                    built.pending.setdefault(item.req_id, []).append(hashes[index])
        self._built = built
        return self.metadata_type.build(scheduler_output.step_id, loads, saves)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Settle the step: its saves of requests no rank failed landed (announced
        stored), its loads in ``invalid_block_ids`` failed (announced ones probed again,
        removed if missing); then :meth:`settle`."""
        built, self._built = self._built, None
        if built is None:
            return
        failed = output.failed_save_req_ids
        landed = [h for req, hs in built.pending.items() if req not in failed for h in hs]
        lost = [built.load_hashes[b] for b in output.invalid_block_ids if b in built.load_hashes]
        events = self.kv_events
        if events is not None:
            events.stored(landed)
            if lost:
                events.recheck(lost, self.probe)
        self.settle(landed, lost)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """Stop tracking ``request``; nothing is delayed (this step's saves of it are
        written by the workers before the step ends, and still announced)."""
        tracker = self._trackers.pop(request.request_id, None)
        self.num_unsaved_blocks += unsaved_at_finish(tracker, self.block_size, self.name)
        self._matches.pop(request.request_id, None)
        return RequestFinishedResult()

    def set_kv_event_sink(self, sink: KVEventSink) -> None:
        """Publish what this engine knows the store holds into ``sink``, under
        :attr:`medium` (see the module docstring)."""
        self.kv_events = StoreEvents(sink.for_medium(self.medium))

    @property
    def num_tracked_requests(self) -> int:
        """Requests being tracked (0 once every request finished)."""
        return len(self._trackers)
