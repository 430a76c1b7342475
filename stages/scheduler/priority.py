"""Priority preemption: room for a waiting request that outranks a running one.

Under the priority policy both queues are kept in ``(priority, arrival_time)`` order
(:func:`~stages.scheduler.state.priority_key`), so the running pass preempts the worst
running request first when the pool runs out, as vLLM does. Before the running pass,
:func:`make_room` goes down the waiting queue, best first: a request that could start
(not parked for a KV load, not waiting for its grammar, its LoRA adapter allowed) but
finds no free slot in ``max_num_seqs`` or too few free blocks for its first chunk
preempts, by recompute, the worst running request while that one has a strictly lower
priority (a larger number); equal priorities never preempt each other, so nothing
thrashes. Preempting before anything of the step is scheduled means no scheduled work is
taken back and no block registered in the step is freed under a request that reads it.

The block count is an estimate (the request's first chunk past its prefix-cache hit,
as :meth:`~stages.scheduler.kv_manager.KVCacheManager.allocate_slots` counts it, not
what the running requests grow by in the step): a request that still does not fit
waits for the next step, where it is looked at again.
"""

from __future__ import annotations

from pipeline.request import Request, RequestStatus
from stages.scheduler.state import SchedulerState

__all__ = ["make_room"]

_READY = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def make_room(
    state: SchedulerState,
    victims: list[Request],
    *,
    free_slots: int,
    max_loras: int,
    max_num_batched_tokens: int,
) -> set[str]:
    """Preempt running requests for waiting ones of a higher priority; the ids of the
    requests preempted (they wait at least until the next step).

    Args:
        state: The scheduler's state (priority order).
        victims: The running requests that may be preempted, worst last (those whose
            tokens in flight end them are left out: their slot counts as free).
        free_slots: Slots of ``max_num_seqs`` free before anything is preempted.
        max_loras: Most adapters among the running requests.
        max_num_batched_tokens: The step's token budget (a first chunk's size at most).
    """
    preempted: set[str] = set()
    reserved = 0  # blocks counted for the requests looked at before
    adapters = {r.lora.content_id for r in state.running if r.lora is not None}
    index = 0
    while index < len(state.waiting) and victims:
        request = state.waiting[index]
        index += 1  # a victim goes behind ``request`` (a worse key): indexes hold
        if request.priority >= victims[-1].priority:
            break  # nobody behind it outranks a running request either
        if request.status not in _READY:
            continue
        lora = request.lora
        if lora is not None and lora.content_id not in adapters and len(adapters) >= max_loras:
            continue
        need = _blocks_needed(state, request, max_num_batched_tokens)
        while (
            free_slots < 1 or state.kv.num_free_blocks - reserved < need
        ) and request.priority < victims[-1].priority:
            victim = victims.pop()
            state.preempt(victim)
            preempted.add(victim.request_id)
            free_slots += 1
            if not victims:
                break
        if free_slots < 1 or state.kv.num_free_blocks - reserved < need:
            break  # it cannot start: nobody behind it jumps the queue
        free_slots -= 1
        reserved += need
    return preempted


def _blocks_needed(state: SchedulerState, request: Request, max_num_batched_tokens: int) -> int:
    """Free blocks ``request``'s first chunk would take (its prefix-cache hit included)."""
    kv = state.kv
    if kv.has_blocks(request.request_id):  # an async load completed: the next token
        return 1
    hit = kv.get_computed_blocks(request)
    if request.needs_prompt_logprobs:
        hit = hit._replace(blocks=[], num_computed_tokens=0)
    num_tokens = min(request.num_tokens, hit.num_computed_tokens + max_num_batched_tokens)
    num_blocks = -(-num_tokens // kv.block_size)
    revived = sum(1 for block in hit.blocks if block.ref_cnt == 0)
    return max(0, num_blocks - len(hit.blocks)) + revived
