"""The scheduler: which tokens of which requests each engine step computes.

Continuous batching in the style of vLLM V1 (see :mod:`stages.scheduler.policy`) over a
block pool with prefix caching, preemption by recompute, and the KV connector's
scheduler hooks. The engine calls, per step::

    so = scheduler.schedule()                      # step_id increments every call
    ... workers run so, fan-in merges their outputs into out ...
    outs = scheduler.update_from_output(so, out)   # or fail_requests(...) if it failed

and, between steps, ``add_request`` / ``abort_requests`` / ``stop_requests``. Everything
is synchronous, never blocks, and must be called from one thread (the engine's event
loop); none of it awaits, so there is no cancellation point inside a call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, KeysView, Mapping
from types import MappingProxyType

from connectors.base import KVConnectorScheduler
from pipeline.artifacts import FanInOutput, SchedulerOutput, SpecDecodeStats
from pipeline.block_hashes import BlockHasher
from pipeline.checks import check_int
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError, InvalidRequestError, StageError
from pipeline.logger import get_logger
from pipeline.request import Request, RequestOutput, RequestStatus
from stages.scheduler.apply_output import UpdatePolicy, apply_output
from stages.scheduler.kv_manager import KVCacheManager
from stages.scheduler.lookahead import resolve_ahead
from stages.scheduler.metadata import with_connector_metadata
from stages.scheduler.policy import SchedulingLimits, ahead_done, grammar_pending, plan_step
from stages.scheduler.settings import SchedulerSettings
from stages.scheduler.state import SchedulerState

log = get_logger()

__all__ = ["Scheduler"]


class Scheduler:
    """Schedules requests onto a fixed pool of KV blocks, one step at a time.

    Args:
        settings: The sizes, seed and policies (see :class:`SchedulerSettings`).
        num_blocks: KV blocks in each worker's paged cache.
        connector: The KV connector's scheduler half, or ``None``.

    Raises:
        InvalidConfigError: ``num_blocks`` is not a positive integer.
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        num_blocks: int,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        check_int("num_blocks", num_blocks, InvalidConfigError, lo=1)
        block_size = settings.block_size
        self.settings = settings
        self.block_size = block_size
        self.max_model_len = settings.max_model_len
        self._state = SchedulerState(
            kv=KVCacheManager(num_blocks, block_size, settings.enable_prefix_caching),
            hasher=BlockHasher(block_size, settings.hash_seed),
            connector=connector,
            by_priority=settings.scheduling_policy == "priority",
        )
        max_len = min(settings.max_model_len, num_blocks * block_size)
        self._limits = SchedulingLimits(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_len=max_len,
            max_loras=settings.max_loras,
            by_priority=settings.scheduling_policy == "priority",
            tenant_fair_share=settings.tenant_fair_share,
        )
        self._update_policy = UpdatePolicy(
            max_model_len=max_len,
            block_size=block_size,
            load_failure_policy=settings.load_failure_policy,
        )
        self._next_step_id = 0

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        num_blocks: int,
        connector: KVConnectorScheduler | None,
    ) -> Scheduler:
        """A scheduler with the sizes, seed and policy of ``config``
        (:meth:`SchedulerSettings.from_config`)."""
        return cls(
            SchedulerSettings.from_config(config), num_blocks=num_blocks, connector=connector
        )

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._state.kv.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached free blocks included)."""
        return self._state.kv.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return self._state.kv.block_pool.num_cached_blocks

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The block manager, for introspection (tests, metrics); do not mutate it."""
        return self._state.kv

    @property
    def requests(self) -> Mapping[str, Request]:
        """Read-only view of every unfinished request by id."""
        return MappingProxyType(self._state.requests)

    @property
    def connector(self) -> KVConnectorScheduler | None:
        """The connector's scheduler half, or ``None``."""
        return self._state.connector

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (status ``WAITING``) behind the requests already waiting
        (under the priority policy: behind those of a lower or equal
        ``(priority, arrival_time)``).

        Hashes its full prompt blocks. The engine validates prompts and sampling
        parameters first; this only refuses what would break the scheduler.

        Raises:
            InvalidRequestError: The id is already in use (unfinished, or finished with
                its blocks still held for a transfer); the prompt is empty, longer than
                ``max_model_len``, or needs more blocks than the pool has.
        """
        req_id = request.request_id
        state = self._state
        if req_id in state.requests or req_id in state.delayed_free:
            raise InvalidRequestError(
                "request_id", req_id, "must be unique among unfinished requests"
            )
        num_prompt = request.num_prompt_tokens
        capacity = self.num_blocks * self.block_size
        if num_prompt == 0:
            raise InvalidRequestError("prompt length", 0, "must be at least 1 token")
        if num_prompt > min(self.max_model_len, capacity):
            raise InvalidRequestError(
                "prompt length",
                num_prompt,
                f"must be <= max_model_len={self.max_model_len} and <= the KV pool "
                f"capacity of {capacity} tokens",
            )
        request.status = (
            RequestStatus.WAITING
            if request.grammar_wait is None
            else RequestStatus.WAITING_FOR_GRAMMAR
        )
        state.hasher.update(request)
        state.requests[req_id] = request
        state.enqueue(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish the given requests with ``"abort"`` and free their blocks now.

        Unknown ids (never added, or already finished) are ignored. Their ids reach the
        workers in the next ``SchedulerOutput.finished_req_ids``. A step that is in
        flight for them still completes; its tokens for them are dropped.

        Returns:
            One final output per request actually aborted.
        """
        return self._state.finish_all(req_ids, RequestStatus.FINISHED_ABORTED, None)

    def stop_requests(self, req_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish the given requests with ``"stop"`` (a stop string matched their text)
        and free their blocks now, as :meth:`abort_requests` does: the connector's
        ``request_finished`` sees them, and their ids reach the workers in the next
        ``SchedulerOutput.finished_req_ids``. Unknown ids are ignored.

        Returns:
            One final output per request actually stopped.
        """
        return self._state.finish_all(req_ids, RequestStatus.FINISHED_STOPPED, None)

    def fail_requests(self, req_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """Finish the given requests with ``"error"`` (a failed step fails its requests
        alone; pass every request of that step).

        The prefix-cache entries those requests registered in the last ``schedule()``
        are dropped before their blocks are freed: the failed step never wrote that
        KV, so no later request may reuse it. Unknown ids are ignored (their cache
        entries are dropped all the same).

        Returns:
            One final output per request actually failed.
        """
        ids = list(req_ids)
        for req_id in ids:
            self._state.kv.uncache_step_blocks(req_id)
        return self._take_pending(self._state.finish_all(ids, RequestStatus.FINISHED_ERROR, error))

    @property
    def next_step_id(self) -> int:
        """The ``step_id`` the next ``schedule()`` call will produce."""
        return self._next_step_id

    def schedule(self, *, ahead: bool = False) -> SchedulerOutput:
        """Decide the next step; ``step_id`` increases by one on every call, even when
        nothing is scheduled. With a connector, ``build_connector_meta`` is called once
        with the finished output and its result is attached as
        ``kv_connector_metadata``.

        ``ahead``: the previous step's output is not applied yet (async scheduling);
        the metadata is built by :meth:`resolve_ahead` once it is."""
        step_id = self._next_step_id
        self._next_step_id += 1
        output = plan_step(self._state, self._limits, step_id, ahead=ahead)
        return output if ahead else with_connector_metadata(self._state, output)

    def resolve_ahead(self, output: SchedulerOutput, *, previous_failed: bool) -> SchedulerOutput:
        """The step ``output``, planned while the step before it ran (async scheduling),
        as it runs now that the step before was applied or failed: placeholders filled
        in, ended requests out, and run empty after a failure
        (:func:`~stages.scheduler.lookahead.resolve_ahead`); with a connector, its
        metadata is built now."""
        resolved = resolve_ahead(self._state, output, previous_failed=previous_failed)
        return with_connector_metadata(self._state, resolved)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: FanInOutput
    ) -> list[RequestOutput]:
        """Apply the merged worker output of ``scheduler_output``'s step.

        Appends sampled tokens, stops requests (stop/EOS, ``max_tokens``,
        ``max_model_len``), frees finished requests (or keeps their blocks while the
        connector sends them), handles load errors, completed loads and sends, and
        calls the connector's ``update_connector_output`` once.

        Returns:
            One output per request that got a new token or finished, in batch order.

        Raises:
            StageError: ``output`` belongs to a different step than ``scheduler_output``.
        """
        if output.step_id != scheduler_output.step_id:
            raise StageError(
                "update",
                scheduler_output.step_id,
                f"fan-in output of step {output.step_id} does not match this step",
            )
        outputs = apply_output(self._state, scheduler_output, output, self._update_policy)
        self._state.kv.forget_step(scheduler_output.step_id)
        return self._take_pending(outputs)

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (a request preempted twice counts twice)."""
        return self._state.num_preemptions

    @property
    def spec_decode_counts(self) -> tuple[int, int]:
        """Speculative drafts verified so far, and how many of them were kept."""
        stats = self._state.spec_decode
        return stats.num_draft_tokens, stats.num_accepted_tokens

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Speculative decoding's counts over every step applied so far."""
        return self._state.spec_decode

    @property
    def step_draft_outcomes(self) -> Mapping[str, tuple[int, int]]:
        """Of the step :meth:`update_from_output` applied last: each drafted request's
        ``(drafts verified, drafts kept)``."""
        return self._state.step_draft_outcomes

    def propose_drafts(self, drafts: Callable[[Request], list[int]]) -> int:
        """Give each running request whose next step is a decode the drafts
        ``drafts(request)`` returns (speculative decoding; the next :meth:`schedule` puts
        them after its token); the number of drafts given. Call after
        :meth:`update_from_output`, not while a step is planned ahead."""
        given = 0
        for request in self._state.running:
            if request.status != RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != request.num_tokens - 1:
                request.draft_token_ids = []
                continue
            request.draft_token_ids = list(drafts(request))
            given += len(request.draft_token_ids)
        return given

    def _take_pending(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Prepend the outputs of requests that failed while the step was planned."""
        if not self._state.pending_outputs:
            return outputs
        pending = self._state.pending_outputs
        self._state.pending_outputs = []
        return [*pending, *outputs]

    def has_unfinished_requests(self, *, ahead: bool = False) -> bool:
        """Whether the engine must keep stepping: requests to run, or finished requests
        whose blocks wait for a transfer to complete.

        ``ahead``: whether a step planned now, before the one in flight is applied
        (async scheduling), could compute anything: a request waiting (not parked for
        a transfer), or a running request that the tokens in flight do not end."""
        state = self._state
        if not ahead:
            if state.delayed_free or len(state.requests) > len(state.waiting):
                return True
            return any(not grammar_pending(r) for r in state.waiting)
        parked = RequestStatus.WAITING_FOR_REMOTE_KVS
        if any(r.status != parked and not grammar_pending(r) for r in state.waiting):
            return True
        return any(not ahead_done(r, self._limits) for r in state.running)

    def unfinished_request_ids(self) -> KeysView[str]:
        """The ids of the requests admitted and not finished (a live view)."""
        return self._state.requests.keys()

    def num_unfinished_requests(self) -> int:
        """Running plus waiting requests (parked async loads included); what admission
        control counts."""
        return len(self._state.running) + len(self._state.waiting)

    def leak_report(self) -> dict[str, int]:
        """``blocks_in_use``, ``requests``, ``waiting``, ``running`` and
        ``pending_transfers``: all zero once nothing is left in flight (cached free
        blocks are not counted; see :attr:`num_cached_blocks`)."""
        return self._state.leak_report()
