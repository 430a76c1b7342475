"""Resolving a step that was scheduled ahead (async scheduling).

With async scheduling the engine plans step N+1 while step N runs, so N+1 may hold
:data:`~pipeline.artifacts.PLACEHOLDER_TOKEN` where a request's token sampled in N
belongs. Once N's output is applied (or N failed), :func:`resolve_ahead` makes N+1 what
a step planned after N would have run:

- a placeholder becomes the token N sampled for that request (now in its
  ``all_token_ids``); when N gave the request several tokens, the token N+1 was to
  sample is known already, so N+1 computes its chunk without sampling (the next step
  computes the rest of N's tokens and samples);
- a request that ended since N+1 was planned (stopped by N's token, aborted, failed
  with N) leaves the step; its id already waits in the next step's
  ``finished_req_ids``;
- when N failed, every request of N+1 still alive is preempted by recompute (it may
  have hit prefix-cache blocks that N was to write, which N's failure took back out of
  the cache): it loses nothing and runs again later, and N+1 runs empty. Only N's own
  requests fail;
- a request whose progress N's output changed (blocks that failed to load truncated
  it) leaves N+1 and keeps its blocks: the next step recomputes from where the
  truncation left it, as without async scheduling.

The connector's ``build_connector_meta`` for N+1 is called here, after N's
``update_connector_output``, in the order the connector sees without async
scheduling; only the admission hooks of N+1 (``get_num_new_matched_tokens``,
``update_state_after_alloc``) come before N's update.

Synchronous bookkeeping on the scheduler's state; never blocks.
"""

from __future__ import annotations

import time

import attrs

from pipeline.artifacts import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from pipeline.logger import get_logger
from pipeline.request import RequestStatus
from stages.scheduler.state import SchedulerState

__all__ = ["resolve_ahead"]

log = get_logger()


def resolve_ahead(
    state: SchedulerState, output: SchedulerOutput, *, previous_failed: bool
) -> SchedulerOutput:
    """``output`` (planned before the previous step's output was applied) as it runs.

    Args:
        state: The scheduler's state, with the previous step applied or failed.
        output: The step planned ahead; its ``requests`` may hold placeholders.
        previous_failed: The previous step failed (its requests failed alone).

    Returns:
        ``output`` itself when nothing changed, else a copy without the requests that
        left it and with every placeholder filled in.
    """
    kept: list[ScheduledRequest] = []
    preempt: list[str] = []
    changed = False
    now = time.monotonic()
    for item in output.requests:
        request = state.requests.get(item.req_id)
        if request is None or request.status != RequestStatus.RUNNING:
            changed = True  # ended since planned: its id reaches the workers next step
            continue
        start = item.num_computed_tokens
        stop = start + len(item.token_ids)
        if not previous_failed and request.num_computed_tokens != stop:
            _skip(state, item)  # truncated by a failed load: the next step recomputes
            changed = True
            continue
        if previous_failed or stop > request.num_tokens:
            if not previous_failed:  # never: a token not applied ends or truncates it
                log.error(
                    "request scheduled ahead has no token to run; preempted",
                    req_id=item.req_id,
                    step_id=output.step_id,
                )
            preempt.append(item.req_id)
            changed = True
            continue
        if request.first_scheduled_time is None:  # admitted into this step
            request.first_scheduled_time = now
        if not item.token_ids or item.token_ids[-1] != PLACEHOLDER_TOKEN:
            kept.append(item)
            continue
        known = tuple(request.all_token_ids[start:stop])
        if item.sample and stop < request.num_tokens:  # N sampled this token already
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            kept.append(attrs.evolve(item, token_ids=known, sample=False))
        else:
            kept.append(attrs.evolve(item, token_ids=known))
        changed = True
    for req_id in reversed(preempt):  # front of the queue, in their batch order
        state.kv.uncache_step_blocks(req_id)
        state.preempt(state.requests[req_id])
    if not changed:
        return output
    return attrs.evolve(output, requests=tuple(kept))


def _skip(state: SchedulerState, item: ScheduledRequest) -> None:
    """Take ``item`` out of its step, as if it had not been planned: the workers never
    get its new blocks (they come with the request's next step), and a token it was to
    sample is not waited for. The request keeps its blocks and its (truncated)
    progress, whose registrations past it the truncation already took back out."""
    req_id = item.req_id
    log.info("request scheduled ahead was truncated before its step ran; skipped", req_id=req_id)
    if item.new:
        state.sent_blocks.pop(req_id, None)
    elif req_id in state.sent_blocks:
        state.sent_blocks[req_id] -= len(item.block_ids)
    request = state.requests[req_id]
    if item.sample and request.num_output_placeholders:
        request.num_output_placeholders -= 1
