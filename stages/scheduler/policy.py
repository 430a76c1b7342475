"""One scheduling decision: vLLM-V1-style continuous batching over a token budget.

Running requests go first, in admission order, each taking ``min(remaining tokens,
remaining budget)`` (a decode token or the next prefill chunk). As in vLLM V1, the
remaining tokens are those up to ``num_tokens_with_spec``: a request's draft tokens
(speculative decoding) follow its last known token in the same step, count against the
budget and get KV slots like any other (the update takes rejected ones back), and are
consumed when scheduled. When the pool cannot
hold a running request's next tokens, the last running request is preempted by
recompute, repeatedly, until the allocation fits or the request itself was the last one.
Then, only if nobody was preempted, waiting requests are admitted in queue order
(first come first served; under the priority policy by ``(priority, arrival_time)``,
:mod:`stages.scheduler.priority`, which also preempts lower-priority running requests
for a higher one before the running pass; with tenant fair share, the tenant with the
fewest running requests first, :mod:`stages.scheduler.tenants`) while the budget,
``max_num_seqs`` and the pool allow: local prefix-cache hit,
the connector's external match, allocation, ``update_state_after_alloc``; one whose LoRA
adapter would make the running requests' adapters more than ``max_loras`` is skipped
(it keeps its place; others behind it may start), as in vLLM. A request the
connector loads asynchronously is parked in ``WAITING_FOR_REMOTE_KVS`` instead of
running. ``num_computed_tokens`` is advanced when a request is scheduled, so the next
step can schedule its next token.

A step may be planned before the previous one's outputs are applied (async
scheduling): a request that samples in a step counts one output placeholder until its
token is applied, and the next step schedules that token as
:data:`~pipeline.artifacts.PLACEHOLDER_TOKEN` (the engine fills it in before the step
runs, :mod:`stages.scheduler.lookahead`). A request whose placeholder would reach
``max_tokens`` or the longest length is not scheduled ahead: it finishes with it. Drafts
follow known tokens only: a request with a token in flight is scheduled without them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import attrs

from pipeline.artifacts import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from pipeline.grammar.compiler import timed_out
from pipeline.logger import get_logger
from pipeline.request import Request, RequestStatus
from stages.scheduler.kv_manager import ComputedBlocks
from stages.scheduler.priority import make_room
from stages.scheduler.state import SchedulerState, make_output
from stages.scheduler.tenants import FairOrder

__all__ = ["SchedulingLimits", "ahead_done", "plan_step"]

log = get_logger()


@attrs.frozen(kw_only=True)
class SchedulingLimits:
    """The per-step limits of the policy.

    Attributes:
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Tokens computed in one step, over all requests.
        max_len: Tokens a request may reach (``max_model_len``, at most the pool's
            capacity); a request is not scheduled ahead past it.
        max_loras: Most LoRA adapters among the running requests.
        by_priority: The priority policy: a waiting request of a higher priority
            preempts lower-priority running ones when it cannot start
            (:func:`~stages.scheduler.priority.make_room`).
        tenant_fair_share: Offer free slots in tenant fair-share order
            (:class:`~stages.scheduler.tenants.FairOrder`).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_len: int | None = None
    max_loras: int = 1
    by_priority: bool = False
    tenant_fair_share: bool = False


class _RunningPass(NamedTuple):
    budget: int
    preempted: bool
    ending: int  # running requests that their tokens in flight end (async scheduling)


class _Admission:
    """What a waiting request would start from: its cached and external prefix."""

    __slots__ = ("hit", "load_async", "num_external")

    def __init__(self, hit: ComputedBlocks, num_external: int, load_async: bool) -> None:
        self.hit = hit
        self.num_external = num_external
        self.load_async = load_async


def plan_step(
    state: SchedulerState, limits: SchedulingLimits, step_id: int, *, ahead: bool = False
) -> SchedulerOutput:
    """Decide step ``step_id``: mutate ``state`` and return the step's output.

    The returned output has no connector metadata yet; the caller adds it. Synchronous;
    calls the connector's scheduler hooks, which must not block. ``ahead``: the step is
    planned before the previous one is applied; the requests it admits get their
    ``first_scheduled_time`` when it is resolved, i.e. when it runs.
    """
    state.kv.start_step(step_id)
    scheduled: list[ScheduledRequest] = []
    held_back: set[str] = set()
    if limits.by_priority and state.waiting and state.running:
        held_back = _make_room(state, limits)
    running = _schedule_running(state, limits, scheduled)
    if not running.preempted:
        _schedule_waiting(
            state, limits, running.budget, running.ending, scheduled, ahead, held_back
        )
    finished = frozenset(state.finished_req_ids)
    state.finished_req_ids.clear()
    return SchedulerOutput(step_id=step_id, requests=tuple(scheduled), finished_req_ids=finished)


def ahead_done(request: Request, limits: SchedulingLimits) -> bool:
    """Whether ``request``'s pending placeholders already end it (``max_tokens`` or the
    longest length): scheduling it again would only compute a token to drop."""
    pending = request.num_output_placeholders
    if not pending:
        return False
    if request.num_output_tokens + pending >= request.sampling_params.max_tokens:
        return True
    return limits.max_len is not None and request.num_tokens + pending >= limits.max_len


def _make_room(state: SchedulerState, limits: SchedulingLimits) -> set[str]:
    """Priority preemption before the running pass (:mod:`stages.scheduler.priority`);
    the ids preempted. Both queues are in priority order, so the first waiting request
    and the last running one tell at once whether anyone outranks anyone."""
    if state.waiting[0].priority >= state.running[-1].priority:
        return set()
    victims = [r for r in state.running if not ahead_done(r, limits)]
    ending = len(state.running) - len(victims)
    return make_room(
        state,
        victims,
        free_slots=limits.max_num_seqs - len(state.running) + ending,
        max_loras=limits.max_loras,
        max_num_batched_tokens=limits.max_num_batched_tokens,
    )


def _schedule_running(
    state: SchedulerState, limits: SchedulingLimits, scheduled: list[ScheduledRequest]
) -> _RunningPass:
    budget = limits.max_num_batched_tokens
    preempted = False
    ending = 0
    index = 0
    while index < len(state.running) and budget > 0:
        request = state.running[index]
        if ahead_done(request, limits):
            ending += 1
            index += 1
            continue
        pending = request.num_output_placeholders
        # vLLM's num_tokens_with_spec; drafts never follow a token still in flight.
        known = request.num_tokens + pending if pending else request.num_tokens_with_spec
        num_new = min(known - request.num_computed_tokens, budget)
        if limits.max_len is not None:  # no KV position past the longest length
            num_new = min(num_new, limits.max_len - request.num_computed_tokens)
        if num_new <= 0:
            index += 1
            continue
        while (new_blocks := state.kv.allocate_slots(request, num_new)) is None:
            victim = state.running[-1]
            state.preempt(victim)
            preempted = True
            if victim is request:
                break
        if new_blocks is None:
            break
        scheduled.append(_schedule(state, request, num_new))
        budget -= num_new
        index += 1
    return _RunningPass(budget, preempted, ending)


def _schedule_waiting(
    state: SchedulerState,
    limits: SchedulingLimits,
    budget: int,
    ending: int,
    scheduled: list[ScheduledRequest],
    ahead: bool,
    held_back: set[str],
) -> None:
    """Admit waiting requests, in queue order (FCFS or priority) or in tenant
    fair-share order; one passed over keeps its place in the queue. ``ending`` running
    requests end with the step in flight (async scheduling): their places count as free,
    as they are once it is applied. ``held_back``: requests preempted for priority in
    this step, which wait until the next."""
    if not state.waiting or budget <= 0 or len(state.running) - ending >= limits.max_num_seqs:
        return
    fair = (
        FairOrder(state.waiting, state.running, limits.by_priority, state.tenants)
        if limits.tenant_fair_share
        else None
    )
    now: float | None = None
    adapters: set[str] | None = None  # of the running requests, once one needs them
    for request in list(state.waiting) if fair is None else fair:
        if budget <= 0 or len(state.running) - ending >= limits.max_num_seqs:
            break
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        if held_back and request.request_id in held_back:
            continue
        if request.lora is not None:
            if adapters is None:
                adapters = {r.lora.content_id for r in state.running if r.lora is not None}
            if request.lora.content_id not in adapters and len(adapters) >= limits.max_loras:
                continue  # as vLLM: one more adapter waits
        if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not grammar_ready(
            state, request
        ):
            continue  # still compiling (later), or failed (finished)
        try:
            admission = _admission(state, request)
        except Exception as exc:  # a failing connector lookup fails this request alone
            _fail(state, request, "get_num_new_matched_tokens", exc)
            continue
        if admission is None:  # the connector cannot tell yet: ask again next step
            continue
        hit = admission.hit
        if request.num_cached_tokens < 0 and hit.num_computed_tokens:
            request.num_prefix_cached_tokens = hit.num_computed_tokens
        num_computed = request.num_computed_tokens + hit.num_computed_tokens
        num_computed += admission.num_external
        num_new = 0 if admission.load_async else min(request.num_tokens - num_computed, budget)
        # A parked request reserves room for one more token now: once its load lands it
        # can always run, even when parked loads hold every other block (nothing waiting
        # can preempt, so without the room they would wait for each other forever).
        new_blocks = state.kv.allocate_slots(
            request,
            1 if admission.load_async else num_new,
            hit.num_computed_tokens,
            hit.blocks,
            admission.num_external,
            delay_cache_blocks=admission.load_async,
        )
        if new_blocks is None:  # in order: nobody behind it may jump the queue
            break
        if state.connector is not None:
            try:
                state.connector.update_state_after_alloc(
                    request, state.kv.get_block_ids(request.request_id), admission.num_external
                )
            except Exception as exc:
                _fail(state, request, "update_state_after_alloc", exc)
                continue
        if admission.load_async:  # parked where it waits
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            state.async_loads[request.request_id] = num_computed
            continue
        state.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        if request.first_scheduled_time is None and not ahead:
            if now is None:  # one clock read per step, only when someone is admitted
                now = time.monotonic()
            request.first_scheduled_time = now
        state.start_running(request)
        if fair is not None:
            fair.started(request)
        if adapters is not None and request.lora is not None:
            adapters.add(request.lora.content_id)
        scheduled.append(_schedule(state, request, num_new))
        budget -= num_new


def _fail(state: SchedulerState, request: Request, call: str, exc: Exception) -> None:
    """Fail one waiting request whose connector call raised (``finish`` takes it out of
    the waiting queue); its final output waits in the state for the next update."""
    error = f"connector {call} failed: {exc!r}"
    log.error("connector call failed", req_id=request.request_id, call=call, error=repr(exc))
    state.kv.uncache_step_blocks(request.request_id)  # nothing was computed into them
    state.finish(request, RequestStatus.FINISHED_ERROR, error)
    state.pending_outputs.append(make_output(request, ()))


def grammar_pending(request: Request) -> bool:
    """Whether ``request`` waits for a grammar that is still compiling (in time)."""
    wait = request.grammar_wait
    if wait is None or request.status != RequestStatus.WAITING_FOR_GRAMMAR:
        return False
    return not wait[0].done() and time.monotonic() < wait[1]


def grammar_ready(state: SchedulerState, request: Request) -> bool:
    """Whether ``request``'s grammar compiled: it then waits as any request does. One
    that failed to compile, or not in time, fails alone (its final output waits in the
    state for the next update); one still compiling stays where it is."""
    wait = request.grammar_wait
    assert wait is not None
    future, deadline, timeout_s = wait
    if not future.done():
        if time.monotonic() < deadline:
            return False
        params = request.sampling_params.structured_outputs
        assert params is not None
        error = str(timed_out(params, timeout_s))
    elif (exc := future.exception()) is not None:
        error = str(exc)
    else:
        request.grammar_wait = None
        request.status = RequestStatus.WAITING
        return True
    log.info("structured output failed", req_id=request.request_id, error=error)
    state.finish(request, RequestStatus.FINISHED_ERROR, error)
    state.pending_outputs.append(make_output(request, ()))
    return False


def _admission(state: SchedulerState, request: Request) -> _Admission | None:
    """The prefix ``request`` starts from, or ``None`` when the connector says "later".

    A request that already holds blocks (its async load just finished) starts from its
    own ``num_computed_tokens``; the cache and the connector are not asked again.
    """
    if state.kv.has_blocks(request.request_id):
        return _Admission(ComputedBlocks([], 0), 0, False)
    if request.needs_prompt_logprobs:
        # As vLLM: prompt logprobs need the logits of every prompt position, so the
        # prompt is computed whole; no prefix-cache hit and no connector load (the
        # connector is not asked; it sees a miss in update_state_after_alloc).
        return _Admission(ComputedBlocks([], 0), 0, False)
    hit = state.kv.get_computed_blocks(request)
    if state.connector is None:
        return _Admission(hit, 0, False)
    match = state.connector.get_num_new_matched_tokens(request, hit.num_computed_tokens)
    if match.num_tokens is None:
        return None
    load_async = bool(match.load_async)
    # A synchronous load must leave the last token to compute (its logits are needed);
    # an async load may cover everything and is trimmed when it completes.
    limit = request.num_tokens - hit.num_computed_tokens - (0 if load_async else 1)
    num_external = max(0, min(match.num_tokens, limit))
    if num_external != match.num_tokens:
        log.debug(
            "connector match clamped",
            req_id=request.request_id,
            matched=match.num_tokens,
            used=num_external,
        )
    request.num_external_computed_tokens = num_external
    return _Admission(hit, num_external, load_async and num_external > 0)


def _schedule(state: SchedulerState, request: Request, num_new: int) -> ScheduledRequest:
    """Describe ``request``'s share of this step and advance its computed tokens.

    Tokens past ``request.num_tokens`` (sampled by a step whose output is not applied
    yet) are sent as :data:`PLACEHOLDER_TOKEN`; a request that samples in this step
    counts one more placeholder until :func:`~stages.scheduler.apply_output.apply_output`.
    The part of ``num_new`` past the last known token is the request's drafts (as
    many as fit; the rest are dropped, and every draft is consumed).
    """
    req_id = request.request_id
    block_ids = state.kv.get_block_ids(req_id)
    num_sent = state.sent_blocks.get(req_id)
    start = request.num_computed_tokens
    pending = request.num_output_placeholders
    num_known = min(num_new, request.num_tokens + pending - start)
    token_ids = tuple(request.all_token_ids[start : start + num_known])
    if len(token_ids) < num_known:
        token_ids += (PLACEHOLDER_TOKEN,) * (num_known - len(token_ids))
    draft_token_ids: tuple[int, ...] = ()
    if request.draft_token_ids:
        draft_token_ids = tuple(request.draft_token_ids[: num_new - num_known])
        request.draft_token_ids = []
    sample = start + num_known == request.num_tokens + pending
    item = ScheduledRequest(
        req_id=req_id,
        token_ids=token_ids,
        num_computed_tokens=start,
        block_ids=tuple(block_ids if num_sent is None else block_ids[num_sent:]),
        new=num_sent is None,
        sampling=request.sampling_params,
        sample=sample,
        num_output_tokens=request.num_output_tokens + pending,
        prefix_token_ids=(tuple(request.all_token_ids[:start]) if num_sent is None else ()),
        prompt_logprob_targets=(
            tuple(
                request.all_token_ids[
                    start + 1 : min(start + num_known + 1, request.num_prompt_tokens)
                ]
            )
            if request.needs_prompt_logprobs
            else ()
        ),
        draft_token_ids=draft_token_ids,
        lora=request.lora,
        num_prompt_tokens=request.num_prompt_tokens,
    )
    state.sent_blocks[req_id] = len(block_ids)
    request.num_computed_tokens = start + num_new
    if sample:
        request.num_output_placeholders = pending + 1
    return item
