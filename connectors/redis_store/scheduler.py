"""``RedisScheduler``: the scheduler half of the redis connector.

The store is shared across engines and restarts, so this half keeps no authoritative
index: ``get_num_new_matched_tokens`` asks the server (one pipelined ``EXISTS`` round
trip per request, bounded by ``timeout_s``). A block counts as stored only when the key
of **every** rank's fingerprint exists (with tensor parallelism each rank stores its own
shard), so a hit never leaves one rank without its KV. A server that is down or slow is
a miss, logged at most once per few seconds; nothing reaches the engine.

Saves are the blocks that become full in a step, minus those this half recently saw in
the store (a bounded, expiring cache that only saves bandwidth: a block missing after
all is a load error, and the scheduler recomputes it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import redis

from connectors.base import (
    ConnectorContext,
    KVConnectorOutput,
    KVConnectorScheduler,
    MatchResult,
    RequestFinishedResult,
)
from connectors.redis_store.metadata import BlockTransfer, RedisMetadata
from connectors.redis_store.options import RedisOptions
from connectors.redis_store.store import RateLimitedLog, RedisStore, store_key
from pipeline.errors import InvalidConfigError
from pipeline.logs import get_logger

if TYPE_CHECKING:
    from pipeline.artifacts import ScheduledRequest, SchedulerOutput
    from pipeline.request import Request

__all__ = ["RedisScheduler"]

log = get_logger()

_KNOWN_CAPACITY = 1 << 16  # hashes remembered as stored
_KNOWN_HORIZON_S = 300.0  # how long a remembered hash is trusted (half the TTL if less)


@attrs.define
class _Tracker:
    request: Request
    block_ids: list[int]


@attrs.define
class _BuiltStep:
    load_hashes: dict[int, bytes] = attrs.Factory(dict)  # block id -> hash, its loads
    pending: dict[str, list[bytes]] = attrs.Factory(dict)  # its saves, per request


class RedisScheduler(KVConnectorScheduler):
    """Asks the store what it holds and plans each step's loads and saves.

    Every method runs on the event loop thread; only ``get_num_new_matched_tokens``
    does I/O, bounded by ``timeout_s``.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = RedisOptions.from_options(context.options)
        fingerprint = context.fingerprint
        if fingerprint is None:
            raise InvalidConfigError(
                "ConnectorContext.fingerprint", None, "redis keys every block by the model"
            )
        ranks = range(max(context.world_size, fingerprint.tp_size))
        self.fingerprint_keys = tuple(
            attrs.evolve(fingerprint, tp_rank=r, tp_size=len(ranks)).key() for r in ranks
        )
        self.block_size = context.block_size
        self.store = RedisStore(self.options, self.options.timeout_s)
        ttl = self.options.ttl_s
        self._horizon = _KNOWN_HORIZON_S if ttl is None else min(_KNOWN_HORIZON_S, ttl / 2)
        self._known: OrderedDict[bytes, float] = OrderedDict()
        self._trackers: dict[str, _Tracker] = {}
        self._matches: dict[str, tuple[int, tuple[bytes, ...]]] = {}
        self._loads: list[BlockTransfer] = []
        self._built: _BuiltStep | None = None
        self._warn = RateLimitedLog()

    # ------------------------------------------------------------------ the cache

    def _remember(self, block_hash: bytes) -> None:
        self._known[block_hash] = time.monotonic()
        self._known.move_to_end(block_hash)
        while len(self._known) > _KNOWN_CAPACITY:
            self._known.popitem(last=False)

    def _is_known(self, block_hash: bytes) -> bool:
        seen = self._known.get(block_hash)
        if seen is None:
            return False
        if time.monotonic() - seen > self._horizon:
            del self._known[block_hash]
            return False
        return True

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """The longest run of ``request``'s blocks from ``num_computed_tokens`` on that
        the store holds for every rank, in tokens (whole blocks, never the last prompt
        token). Blocks for at most ``timeout_s``; a server error is 0 tokens, logged."""
        req_id, bs = request.request_id, self.block_size
        self._matches.pop(req_id, None)
        if num_computed_tokens % bs:
            return MatchResult(0, False)
        start = num_computed_tokens // bs
        stop = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        hashes = tuple(request.block_hashes[start:stop])
        if not hashes:
            return MatchResult(0, False)
        prefix, fps = self.options.key_prefix, self.fingerprint_keys
        keys = [store_key(prefix, fp, h) for h in hashes for fp in fps]
        try:
            found = self.store.exists_many(keys)
        except redis.RedisError as exc:
            self._warn.warning("redis: lookup failed, treated as a miss", error=repr(exc))
            return MatchResult(0, False)
        stored = [all(found[n * len(fps) : (n + 1) * len(fps)]) for n in range(len(hashes))]
        for block_hash, here in zip(hashes, stored, strict=True):
            if not here:  # expired, evicted, or the server restarted empty: save it again
                self._known.pop(block_hash, None)
        count = stored.index(False) if False in stored else len(stored)
        for block_hash in hashes[:count]:
            self._remember(block_hash)
        if not count:
            return MatchResult(0, False)
        self._matches[req_id] = (start, hashes[:count])
        return MatchResult(count * bs, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Start tracking ``request`` and register the loads of its matched blocks."""
        req_id = request.request_id
        self._trackers[req_id] = _Tracker(request, list(block_ids))
        match = self._matches.pop(req_id, None)
        if match is None or num_external_tokens <= 0:
            return
        start, hashes = match
        count = min(-(-num_external_tokens // self.block_size), len(hashes))
        for offset, block_hash in enumerate(hashes[:count]):
            self._loads.append(BlockTransfer(req_id, block_ids[start + offset], block_hash))

    # ---------------------------------------------------------------------- step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RedisMetadata:
        """This step's loads (registered at admission) and saves (blocks that become
        full in this step and are not known to be stored). Never blocks."""
        loads, self._loads = self._loads, []
        built = _BuiltStep(load_hashes={t.block_id: t.block_hash for t in loads})
        self._built = built  # a previous step that never came back: its saves are dropped
        saves: list[BlockTransfer] = []
        for item in scheduler_output.requests:
            tracker = self._trackers.get(item.req_id)
            if tracker is None:
                log.debug("redis: scheduled request without a tracker", req_id=item.req_id)
                continue
            if item.new:
                tracker.block_ids = list(item.block_ids)
            else:
                tracker.block_ids.extend(item.block_ids)
            self._plan_saves(tracker, item, built, saves)
        return RedisMetadata.build(scheduler_output.step_id, loads, saves)

    def _plan_saves(
        self,
        tracker: _Tracker,
        item: ScheduledRequest,
        built: _BuiltStep,
        saves: list[BlockTransfer],
    ) -> None:
        bs, hashes = self.block_size, tracker.request.block_hashes
        end = item.num_computed_tokens + len(item.token_ids)
        stop = min(end // bs, len(tracker.block_ids), len(hashes))
        for index in range(item.num_computed_tokens // bs, stop):
            if self._is_known(hashes[index]):
                continue
            built.pending.setdefault(item.req_id, []).append(hashes[index])
            saves.append(BlockTransfer(item.req_id, tracker.block_ids[index], hashes[index]))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Remember the step's saved hashes (not those of failed saves); forget hashes
        whose load failed, so their recomputed blocks are written again."""
        built, self._built = self._built, None
        if built is None:
            return
        for req_id, hashes in built.pending.items():
            if req_id not in output.failed_save_req_ids:
                for block_hash in hashes:
                    self._remember(block_hash)
        for block_id in output.invalid_block_ids:
            lost = built.load_hashes.get(block_id)
            if lost is not None:
                self._known.pop(lost, None)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """Stop tracking ``request``; nothing is delayed."""
        self._trackers.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        return RequestFinishedResult()

    @property
    def num_tracked_requests(self) -> int:
        """Requests being tracked (0 once every request finished)."""
        return len(self._trackers)
