"""The scheduler's mutable state and the transitions every part of it shares.

:class:`SchedulerState` holds the queues, the block manager and the connector; the
step planner (:mod:`stages.scheduler.policy`), the output handler
(:mod:`stages.scheduler.apply_output`) and the :class:`~stages.scheduler.scheduler.Scheduler`
facade all mutate it through :meth:`SchedulerState.finish` and
:meth:`SchedulerState.preempt`, so a request leaves its queue, its worker state and its
blocks in exactly one place. Owned by one scheduler; not thread-safe, never blocks.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import attrs

from connectors.base import KVConnectorScheduler
from pipeline.artifacts import SpecDecodeStats
from pipeline.block_hashes import BlockHasher
from pipeline.errors import InvalidRequestError
from pipeline.logger import get_logger
from pipeline.request import Request, RequestOutput, RequestStatus
from pipeline.transfer_params import check_transfer_params
from stages.scheduler.kv_manager import KVCacheManager
from stages.scheduler.tenants import TenantLedger

__all__ = ["SchedulerState", "make_output", "priority_key"]

log = get_logger()


def make_output(request: Request, new_token_ids: tuple[int, ...]) -> RequestOutput:
    """The caller's view of ``request`` after it got ``new_token_ids`` (or finished)."""
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        token_ids=tuple(request.output_token_ids),
        new_token_ids=new_token_ids,
        finished=request.is_finished,
        finish_reason=request.status.finish_reason,
        error=request.error,
        num_cached_tokens=max(0, request.num_cached_tokens),
        metrics=request.metrics,
        stop_reason=_stop_reason(request),
        logprobs=None if request.logprobs is None else tuple(request.logprobs),
        prompt_logprobs=(
            request.prompt_logprobs if isinstance(request.prompt_logprobs, tuple) else None
        ),
        kv_transfer_params=request.kv_transfer_params if request.is_finished else None,
    )


def priority_key(request: Request) -> tuple[int, float]:
    """Where ``request`` stands under the priority policy: lower first, ties by arrival
    (vLLM's ``(priority, arrival_time)``)."""
    return request.priority, request.arrival_time


def _stop_reason(request: Request) -> int | None:
    """The ``stop_token_ids`` token that stopped ``request``, as vLLM reports it (EOS,
    checked first unless ``ignore_eos``, gives ``None``)."""
    if request.status != RequestStatus.FINISHED_STOPPED or request.num_output_tokens == 0:
        return None
    params = request.sampling_params
    last = request.all_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        return None
    return last if last in params.stop_token_ids else None


def _returned_params(req_id: str, params: object) -> dict[str, Any] | None:
    """A copy of the ``kv_transfer_params`` a connector returned (``None`` if not JSON)."""
    try:
        return check_transfer_params(params)
    except InvalidRequestError as exc:
        log.error(
            "connector returned bad kv_transfer_params; dropped", req_id=req_id, error=str(exc)
        )
        return None


@attrs.define(eq=False)
class SchedulerState:
    """Everything the scheduler knows between calls.

    Attributes:
        kv: Block tables and the prefix cache.
        hasher: Keeps ``request.block_hashes`` up to date.
        connector: The connector's scheduler half, or ``None``.
        requests: Every unfinished request by id (waiting, parked or running).
        waiting: Requests to admit, FCFS; preempted ones go back to the front. Also
            holds requests parked in ``WAITING_FOR_REMOTE_KVS``, skipped until loaded.
            With ``by_priority``, kept in :func:`priority_key` order instead (preempted
            ones go back to their place in it).
        running: Admitted requests, in admission order (the last is preempted first);
            with ``by_priority``, in :func:`priority_key` order (the worst last).
        by_priority: The priority policy orders both queues (:meth:`enqueue`,
            :meth:`start_running`); decided at construction.
        finished_req_ids: Ids that ended since the previous step (finished, aborted,
            failed, preempted); the next ``SchedulerOutput`` carries them.
        sent_blocks: How many entries of each request's block table the workers have;
            absent means the next schedule sends ``new=True`` with the whole table.
        delayed_free: Finished requests whose blocks stay until the connector reports
            ``finished_sending``.
        async_loads: Parked requests and the number of computed tokens they will have
            once their load completes.
        pending_outputs: Final outputs of requests that failed while a step was being
            planned (a connector call raised); the next update returns them.
        num_expired_sending: Delayed frees released because some rank never reported
            the send within the transfer lease (not a leak; a count for metrics).
        num_expired_recving: Parked requests failed because some rank never reported
            the load within the transfer lease.
        load_failures: Requests whose KV failed to load, by cause (their first failed
            block's): the first of each cause is logged at warning level, the rest at
            debug level with this count.
        save_failures: Save-side connector calls that raised, summed over ranks, by
            cause: the first of each cause is logged at warning level, the rest at
            debug level with this count.
        num_preemptions: Requests preempted so far (each time one was).
        spec_decode: Speculative drafts the steps applied so far verified, and the ones
            kept (equal to the token sampled at their position).
        step_draft_outcomes: Of the step applied last, each drafted request's drafts
            verified and kept.
        tenants: When each tenant was last served (tenant fair share; bounded).
    """

    kv: KVCacheManager
    hasher: BlockHasher
    connector: KVConnectorScheduler | None = None
    by_priority: bool = False
    requests: dict[str, Request] = attrs.field(factory=dict)
    waiting: deque[Request] = attrs.field(factory=deque)
    running: list[Request] = attrs.field(factory=list)
    finished_req_ids: set[str] = attrs.field(factory=set)
    sent_blocks: dict[str, int] = attrs.field(factory=dict)
    delayed_free: dict[str, Request] = attrs.field(factory=dict)
    async_loads: dict[str, int] = attrs.field(factory=dict)
    pending_outputs: list[RequestOutput] = attrs.field(factory=list)
    num_expired_sending: int = 0
    num_expired_recving: int = 0
    load_failures: dict[str, int] = attrs.field(factory=dict)
    save_failures: dict[str, int] = attrs.field(factory=dict)
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats = attrs.field(factory=SpecDecodeStats)
    step_draft_outcomes: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    tenants: TenantLedger = attrs.field(factory=TenantLedger)

    def enqueue(self, request: Request) -> None:
        """Put ``request`` in :attr:`waiting`: last (FCFS), or after every request of a
        lower or equal :func:`priority_key` (priority)."""
        if self.by_priority:
            bisect.insort_right(self.waiting, request, key=priority_key)
        else:
            self.waiting.append(request)

    def start_running(self, request: Request) -> None:
        """Put an admitted ``request`` in :attr:`running`: last (FCFS), or in
        :func:`priority_key` order (priority: the worst is last, preempted first)."""
        if self.by_priority:
            bisect.insort_right(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def finish_all(
        self, req_ids: Iterable[str], status: RequestStatus, error: str | None
    ) -> list[RequestOutput]:
        """:meth:`finish` each request of ``req_ids`` still known (others are ignored);
        one final output per request finished."""
        outputs: list[RequestOutput] = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            self.finish(request, status, error)
            outputs.append(make_output(request, ()))
        return outputs

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Move ``request`` to the terminal ``status`` and release what it holds.

        Removes it from its queue, asks the connector (``request_finished``) whether its
        blocks must stay while KV is sent, then frees them or parks them in
        :attr:`delayed_free`. A connector that raises here is logged and its blocks are
        freed anyway: a cleanup path never leaks. ``request.kv_transfer_params`` (the
        request's own until then, which ``request_finished`` may read) becomes a copy of
        what the connector returned: ``None`` without a connector, when it raised, or
        when what it returned is not plain JSON (logged).
        """
        req_id = request.request_id
        was_running = request.status == RequestStatus.RUNNING
        request.status = status
        request.error = error
        request.finished_time = time.monotonic()
        if was_running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        del self.requests[req_id]
        self.sent_blocks.pop(req_id, None)
        self.async_loads.pop(req_id, None)
        self.finished_req_ids.add(req_id)
        delay_free = False
        params = None
        if self.connector is not None:
            try:
                result = self.connector.request_finished(request, self.kv.get_block_ids(req_id))
            except Exception as exc:
                log.error(
                    "connector request_finished failed; freeing blocks",
                    req_id=req_id,
                    error=repr(exc),
                )
            else:
                delay_free = result.delay_free
                params = _returned_params(req_id, result.kv_transfer_params)
        request.kv_transfer_params = params
        if delay_free and self.kv.has_blocks(req_id):
            self.delayed_free[req_id] = request
        else:
            self.kv.free(request)
        log.debug("request finished", req_id=req_id, reason=status.finish_reason)

    def preempt(self, request: Request) -> None:
        """Preempt a running ``request`` by recompute: free its blocks, reset its
        progress, and put it at the front of :attr:`waiting` (with ``by_priority``: at
        its place by :func:`priority_key`). Workers drop its state (its id goes to
        :attr:`finished_req_ids`); it resumes with ``new=True``."""
        if self.running and self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight for it is dropped
        request.draft_token_ids = []  # drafts follow tokens it no longer has computed
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.sent_blocks.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        if self.by_priority:
            bisect.insort_left(self.waiting, request, key=priority_key)
        else:
            self.waiting.appendleft(request)
        log.debug(
            "request preempted",
            req_id=request.request_id,
            num_preemptions=request.num_preemptions,
            num_free_blocks=self.kv.num_free_blocks,
        )

    def release_delayed(self, req_id: str) -> bool:
        """Free the blocks of a delay-freed request; ``False`` if ``req_id`` had none."""
        request = self.delayed_free.pop(req_id, None)
        if request is None:
            return False
        self.kv.free(request)
        return True

    def leak_report(self) -> dict[str, int]:
        """Counts that are all zero when nothing is left in flight."""
        return {
            "blocks_in_use": len(self.kv.block_pool.leak_report()),
            "requests": len(self.requests),
            "waiting": len(self.waiting),
            "running": len(self.running),
            "pending_transfers": len(self.delayed_free) + len(self.async_loads),
        }
