"""``MultiScheduler``: the scheduler half of the multi (tiered) connector.

Every tier is a full connector of its own, built from its entry of ``tiers``::

    get_num_new_matched_tokens   every tier is asked; the longest hit wins, ties go to
                                 the first (fastest) tier; a tier that cannot tell yet
                                 (``None``) makes the answer ``None``
    update_state_after_alloc     the chosen tier gets the external tokens, every other
                                 tier 0 (so it still tracks the request for saving)
    build_connector_meta         each tier's metadata, in a :class:`MultiMetadata`;
                                 promotion: in the first step that computes a request
                                 after its load (the load's own step, or the resume
                                 after an async load), a faster tier sees the blocks
                                 loaded from a slower one as computed in that step, so
                                 it saves them from the paged cache
    set_kv_event_sink            given to every tier (each publishes under its own
                                 medium; it is not contained: a tier that raises fails
                                 the engine's construction)
    everything else              fans out to every tier, each in its own ``try``

A tier that raises is logged and the others still get the call; only the chosen tier's
``update_state_after_alloc`` re-raises (its loads would never happen, so the engine must
fail that request). A tier whose ``build_connector_meta`` raises sends no metadata and
its loads are reported as failed by the workers. Runs on the event loop; never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from connectors.base import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorScheduler,
    MatchResult,
    RequestFinishedResult,
)
from connectors.multi.metadata import MultiMetadata
from connectors.multi.options import MultiOptions
from connectors.options import options_scope, options_where
from connectors.registry import create_connector
from pipeline.logger import get_logger

if TYPE_CHECKING:
    from pipeline.artifacts import ScheduledRequest, SchedulerOutput
    from pipeline.kv_events.sink import KVEventSink
    from pipeline.request import Request

__all__ = ["MultiScheduler"]

log = get_logger()


@attrs.frozen
class _Choice:
    """The tier a request's hit comes from, and where the hit starts (tokens)."""

    tier: int
    num_tokens: int
    start: int


@attrs.frozen
class _Promotion:
    """Tokens ``start:stop`` of ``request`` load from ``tier`` into ``block_ids``."""

    request: Request
    tier: int
    start: int
    stop: int
    block_ids: tuple[int, ...]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MultiScheduler(KVConnectorScheduler):
    """Tiers tried in order (see the module docstring).

    Attributes:
        tiers: Each tier's scheduler half, fastest first.

    Raises:
        InvalidConfigError: Bad options (see :class:`MultiOptions`), or a tier's own.
        UnknownConnectorError: A tier names an unregistered connector.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = MultiOptions.from_options(context.options)
        where = options_where()
        tiers: list[KVConnectorScheduler] = []
        for i, spec in enumerate(self.options.tiers):
            with options_scope(f"{where}['tiers'][{i}]['options']"):
                tiers.append(
                    create_connector(
                        spec.connector,
                        KVConnectorRole.SCHEDULER,
                        attrs.evolve(context, options=dict(spec.options)),
                    )
                )
        self.tiers: tuple[KVConnectorScheduler, ...] = tuple(tiers)
        self._choices: dict[str, _Choice] = {}
        self._loads: list[list[int]] = [[] for _ in self.tiers]
        self._promotions: dict[str, _Promotion] = {}
        # tier -> request -> blocks promoted into it by the step in flight
        self._promoted: dict[int, dict[str, set[int]]] = {}

    def _fan_out(self, call: str, tier: int, exc: Exception) -> None:
        log.error("multi: tier call failed", call=call, tier=tier, error=repr(exc))

    # ------------------------------------------------------------------ admission

    def check_request(self, request: Request) -> None:
        """Every tier's check (the first refusal is raised)."""
        for tier in self.tiers:
            tier.check_request(request)

    def release_transfer(self, kv_transfer_params: dict[str, Any]) -> bool:
        """Every tier's release (whether any freed something)."""
        freed = [tier.release_transfer(kv_transfer_params) for tier in self.tiers]
        return any(freed)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """The longest hit over the tiers (ties: the fastest); ``None`` while any tier
        cannot tell yet. A tier that raises counts as a miss."""
        req_id = request.request_id
        self._choices.pop(req_id, None)
        best: MatchResult | None = None
        best_tokens, best_tier, undecided = 0, -1, False
        for i, tier in enumerate(self.tiers):
            try:
                result = tier.get_num_new_matched_tokens(request, num_computed_tokens)
            except Exception as exc:
                self._fan_out("get_num_new_matched_tokens", i, exc)
                continue
            if result.num_tokens is None:
                undecided = True
            elif result.num_tokens > best_tokens:
                best, best_tokens, best_tier = result, result.num_tokens, i
        if undecided:
            return MatchResult(None, False)
        if best is None:
            return MatchResult(0, False)
        self._choices[req_id] = _Choice(best_tier, best_tokens, num_computed_tokens)
        return best

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Tell the chosen tier the external tokens and every other tier 0, and
        remember a hit from a slower tier for promotion (kept across the re-admission
        that follows an async load, dropped when the block table changed).

        Raises:
            Exception: Whatever the chosen tier's call raised (the request cannot load).
        """
        req_id = request.request_id
        choice = self._choices.pop(req_id, None)
        previous = self._promotions.pop(req_id, None)
        chosen = choice.tier if choice is not None and num_external_tokens > 0 else -1
        if chosen < 0 and previous is not None:  # resumed after an async load: keep it
            first = previous.start // self.context.block_size
            if tuple(block_ids[first : first + len(previous.block_ids)]) == previous.block_ids:
                self._promotions[req_id] = previous
        for i, tier in enumerate(self.tiers):
            if i == chosen:
                tier.update_state_after_alloc(request, block_ids, num_external_tokens)
                continue
            try:
                tier.update_state_after_alloc(request, block_ids, 0)
            except Exception as exc:
                self._fan_out("update_state_after_alloc", i, exc)
        if choice is None or chosen < 0:
            return
        bs = self.context.block_size
        first = choice.start // bs
        loaded = tuple(block_ids[first : first + _cdiv(num_external_tokens, bs)])
        self._loads[chosen].extend(loaded)
        if chosen > 0:
            stop = choice.start + num_external_tokens
            self._promotions[req_id] = _Promotion(request, chosen, choice.start, stop, loaded)

    # ---------------------------------------------------------------------- step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiMetadata:
        """Each tier's metadata; a faster tier sees promoted blocks as computed now."""
        promoted = self._promote(scheduler_output)
        metas: list[KVConnectorMetadata | None] = []
        for i, tier in enumerate(self.tiers):
            try:
                metas.append(tier.build_connector_meta(promoted.get(i, scheduler_output)))
            except Exception as exc:
                self._fan_out("build_connector_meta", i, exc)
                metas.append(None)
        loads = tuple(tuple(blocks) for blocks in self._loads)
        self._loads = [[] for _ in self.tiers]
        return MultiMetadata(
            step_id=scheduler_output.step_id, tiers=tuple(metas), load_block_ids=loads
        )

    def _promote(self, scheduler_output: SchedulerOutput) -> dict[int, SchedulerOutput]:
        """Per faster tier, the step's output with each promoted request's chunk widened
        back to the start of its hit (the loaded blocks are in the paged cache by the
        time each layer is saved, so the tier stores them like computed ones)."""
        self._promoted = {}
        widened: dict[int, dict[str, ScheduledRequest]] = {}
        for item in scheduler_output.requests:
            promo = self._promotions.get(item.req_id)
            if promo is None:
                continue
            del self._promotions[item.req_id]  # the first schedule after the load only
            if item.num_computed_tokens != promo.stop:  # truncated (a load failed): skip
                continue
            tokens = tuple(promo.request.all_token_ids[promo.start : promo.stop])
            wide = attrs.evolve(
                item, num_computed_tokens=promo.start, token_ids=tokens + item.token_ids
            )
            for tier in range(promo.tier):
                widened.setdefault(tier, {})[item.req_id] = wide
                self._promoted.setdefault(tier, {})[item.req_id] = set(promo.block_ids)
        return {
            tier: attrs.evolve(
                scheduler_output,
                requests=tuple(items.get(r.req_id, r) for r in scheduler_output.requests),
            )
            for tier, items in widened.items()
        }

    # -------------------------------------------------------------------- update

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Fan out; a faster tier also hears that its promoted saves failed when the
        blocks they copied failed to load (so it never keeps wrong data)."""
        promoted, self._promoted = self._promoted, {}
        for i, tier in enumerate(self.tiers):
            bad = {
                req_id
                for req_id, blocks in promoted.get(i, {}).items()
                if blocks & output.invalid_block_ids
            }
            tier_output = output
            if bad:
                failed = output.failed_save_req_ids | bad
                tier_output = attrs.evolve(output, failed_save_req_ids=failed)
            try:
                tier.update_connector_output(tier_output)
            except Exception as exc:
                self._fan_out("update_connector_output", i, exc)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """Fan out; the blocks stay while any tier delays their free; the first tier's
        transfer params win."""
        self._choices.pop(request.request_id, None)
        self._promotions.pop(request.request_id, None)
        delay, params = False, None
        for i, tier in enumerate(self.tiers):
            try:
                result = tier.request_finished(request, block_ids)
            except Exception as exc:
                self._fan_out("request_finished", i, exc)
                continue
            delay = delay or result.delay_free
            params = params if params is not None else result.kv_transfer_params
        return RequestFinishedResult(delay, params)

    def set_kv_event_sink(self, sink: KVEventSink) -> None:
        """Give ``sink`` to every tier; each reports its own blocks under its own medium
        (two tiers of one medium would share an index entry: one per kind of tier)."""
        for tier in self.tiers:
            tier.set_kv_event_sink(sink)

    def has_pending_work(self) -> bool:
        """Whether any tier has transfers in flight (a tier that raises counts as idle)."""
        pending = False
        for i, tier in enumerate(self.tiers):
            try:
                pending = tier.has_pending_work() or pending
            except Exception as exc:
                self._fan_out("has_pending_work", i, exc)
        return pending
