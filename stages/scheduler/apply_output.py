"""Applying one step's merged worker output to the scheduler state.

In order: blocks that failed to load (truncate and recompute, or fail the request,
per ``load_failure_policy``; the first request of each cause is logged as a warning,
the later ones at debug level); requests that failed alone in the step
(``request_errors``: ``"error"``, the others are unaffected); sampled tokens, block
hashes and stop checks for the requests the step scheduled (a request's tokens are a
sequence: each is appended and checked in turn, and those after the first that ends
the request are dropped, as vLLM's ``update_from_output`` does; drafts the step
rejected are taken back from its computed tokens); async loads that
completed (``finished_recving``: the request becomes schedulable); sends that
completed (``finished_sending``: delayed blocks are freed); transfers whose fan-in
lease expired (``expired_sending``: delayed blocks are freed anyway;
``expired_recving``: the parked request fails alone with ``"error"``); finally
``update_connector_output`` once. Tokens, loads, sends and expirations of requests the
scheduler no longer knows (aborted while the step ran, or released after they ended)
are logged at debug level and dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from connectors.base import KVConnectorOutput
from pipeline.artifacts import FanInOutput, ScheduledRequest, SchedulerOutput, SpecDecodeStats
from pipeline.logger import get_logger
from pipeline.request import Request, RequestOutput, RequestStatus
from stages.scheduler.state import SchedulerState, make_output

__all__ = ["UpdatePolicy", "append_tokens", "apply_output", "check_stop"]

log = get_logger()


@attrs.frozen(kw_only=True)
class UpdatePolicy:
    """How outputs are applied.

    Attributes:
        max_model_len: A request stops with ``"length"`` once it has this many tokens.
        block_size: Tokens per KV block.
        load_failure_policy: ``"recompute"`` or ``"fail"`` for blocks that fail to load.
    """

    max_model_len: int
    block_size: int
    load_failure_policy: str = "recompute"


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The terminal status ``request`` reached with its last token, or ``None``.

    Checked in this order: a stop token or EOS (unless ``ignore_eos``) → stopped;
    ``max_tokens`` outputs → length; ``max_model_len`` tokens → length.
    """
    params = request.sampling_params
    last = request.all_token_ids[-1]
    if last in params.stop_token_ids or (
        not params.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id
    ):
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_tokens(
    request: Request, token_ids: Sequence[int], max_model_len: int
) -> tuple[tuple[int, ...], RequestStatus | None]:
    """Append ``token_ids`` to ``request`` one at a time, checking for a stop after
    each (:func:`check_stop`); the tokens after the first that ends the request are
    dropped.

    Returns:
        The tokens appended, and the terminal status reached (``None``: still running).
    """
    for count, token in enumerate(token_ids, 1):
        request.append_output_token(int(token))
        status = check_stop(request, max_model_len)
        if status is not None:
            return tuple(request.all_token_ids[-count:]), status
    return tuple(request.all_token_ids[request.num_tokens - len(token_ids) :]), None


def _take_back_rejected(request: Request, item: ScheduledRequest, token_ids: Sequence[int]) -> int:
    """Take the drafts of ``item`` the step rejected back from ``request``'s computed
    tokens (their KV is not the sequence's: the next step computes those positions
    again). A draft is accepted when it equals the token sampled at its position; the
    last token sampled is never a draft's (it follows them), so at least that one is
    left to compute. Returns how many were rejected."""
    drafts = item.draft_token_ids
    if not drafts:
        return 0
    accepted = 0
    for draft, token in zip(drafts, token_ids[:-1], strict=False):
        if draft != token:
            break
        accepted += 1
    rejected = len(drafts) - accepted
    request.num_computed_tokens -= rejected
    return rejected


def apply_output(
    state: SchedulerState,
    scheduler_output: SchedulerOutput,
    output: FanInOutput,
    policy: UpdatePolicy,
) -> list[RequestOutput]:
    """Apply ``output`` (step ``scheduler_output.step_id``) and return one
    :class:`RequestOutput` per request that got a token or finished."""
    outputs: list[RequestOutput] = []
    discarded = _handle_load_errors(state, scheduler_output, output, policy, outputs)
    now: float | None = None
    state.step_draft_outcomes = outcomes = {}
    for item in scheduler_output.requests:
        req_id = item.req_id
        request = state.requests.get(req_id)
        if item.sample and request is not None and request.num_output_placeholders:
            request.num_output_placeholders -= 1  # this step's token: applied or never
        if request is None or request.status != RequestStatus.RUNNING:
            if req_id in output.sampled_token_ids:
                log.debug("token of a request no longer running dropped", req_id=req_id)
            continue
        reason = output.request_errors.get(req_id)
        if reason is not None:  # failed alone on a worker, or never sent to one
            log.error("request failed in step", req_id=req_id, step=output.step_id, error=reason)
            state.finish(request, RequestStatus.FINISHED_ERROR, f"step {output.step_id}: {reason}")
            outputs.append(make_output(request, ()))
            continue
        if req_id in discarded:
            continue
        tokens = output.sampled_token_ids.get(req_id)
        error = _record_logprobs(request, item, output, tokens)
        if error is not None:
            log.error("missing logprobs", req_id=req_id, step=output.step_id, error=error)
            state.finish(request, RequestStatus.FINISHED_ERROR, f"step {output.step_id}: {error}")
            outputs.append(make_output(request, ()))
            continue
        if not item.sample:
            continue
        if not tokens:
            error = f"step {scheduler_output.step_id}: no token was sampled for {req_id!r}"
            log.error("missing sampled token", req_id=req_id, step=scheduler_output.step_id)
            state.finish(request, RequestStatus.FINISHED_ERROR, error)
            outputs.append(make_output(request, ()))
            continue
        if now is None:  # one clock read per step
            now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if item.draft_token_ids:
            drafted = len(item.draft_token_ids)
            accepted = drafted - _take_back_rejected(request, item, tokens)
            outcomes[req_id] = (drafted, accepted)
        new_tokens, status = append_tokens(request, tokens, policy.max_model_len)
        if request.logprobs is not None and len(request.logprobs) > request.num_output_tokens:
            del request.logprobs[request.num_output_tokens :]  # those of dropped tokens
        state.hasher.update(request)
        if status is not None:
            state.finish(request, status)
        outputs.append(make_output(request, new_tokens))
    if outcomes:
        state.spec_decode += SpecDecodeStats.of(outcomes.values())
    _finish_recving(state, output.finished_recving)
    _finish_sending(state, output)
    _expire_transfers(state, output, outputs)
    if state.connector is not None:
        result = KVConnectorOutput(
            finished_sending=output.finished_sending,
            finished_recving=output.finished_recving,
            expired_sending=output.expired_sending,
            expired_recving=output.expired_recving,
            invalid_block_ids=output.invalid_block_ids,
            failed_save_req_ids=output.failed_save_req_ids,
        )
        try:
            state.connector.update_connector_output(result)
        except Exception as exc:  # the requests of this step are done; keep their outputs
            log.error(
                "connector update_connector_output failed",
                step_id=scheduler_output.step_id,
                error=repr(exc),
            )
    return outputs


def _record_logprobs(
    request: Request,
    item: ScheduledRequest,
    output: FanInOutput,
    tokens: Sequence[int] | int | None,
) -> str | None:
    """Store the step's prompt logprobs of ``request`` (at the positions its chunk
    scored; a recomputed chunk overwrites) and the logprob of each of its sampled
    ``tokens`` (a bare ``int``: one token; the caller drops those of tokens it does not
    keep). Returns why they are missing or inconsistent, or ``None`` when all is well."""
    targets = item.prompt_logprob_targets
    if targets and isinstance(request.prompt_logprobs, list):
        entries = output.prompt_logprobs.get(item.req_id, ())
        if tuple(e.token_id for e in entries) != targets:
            return "the prompt logprobs of the step are missing"
        start = item.num_computed_tokens + 1
        stored = request.prompt_logprobs
        if start > len(stored):
            return f"prompt logprobs from position {start} leave a gap after {len(stored)}"
        stored[start : start + len(entries)] = entries
        if len(stored) >= request.num_prompt_tokens:
            request.prompt_logprobs = tuple(stored[: request.num_prompt_tokens])
    if item.sample and tokens is not None and request.logprobs is not None:
        if isinstance(tokens, int):
            tokens = (tokens,)
        entries = output.logprobs.get(item.req_id, ())
        if len(entries) != len(tokens) or any(
            e.token_id != t for e, t in zip(entries, tokens, strict=True)
        ):
            return "the logprob of the sampled token is missing"
        request.logprobs.extend(entries)
    return None


def _handle_load_errors(
    state: SchedulerState,
    scheduler_output: SchedulerOutput,
    output: FanInOutput,
    policy: UpdatePolicy,
    outputs: list[RequestOutput],
) -> set[str]:
    """Requests whose KV failed to load: truncate to the last valid block (recompute)
    or fail them. Returns the ids whose sampled token must be discarded."""
    invalid = output.invalid_block_ids
    if not invalid:
        return set()
    candidates = [state.requests.get(item.req_id) for item in scheduler_output.requests]
    candidates += [state.requests.get(req_id) for req_id in list(state.async_loads)]
    affected: set[str] = set()
    for request in candidates:
        if request is None or request.request_id in affected:
            continue
        req_id = request.request_id
        block_ids = state.kv.get_block_ids(req_id)
        first = next((i for i, b in enumerate(block_ids) if b in invalid), None)
        if first is None:
            continue
        valid = first * policy.block_size
        parked = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if parked:
            expected = state.async_loads[req_id]
        elif request.status == RequestStatus.RUNNING:
            expected = request.num_computed_tokens
        else:
            continue
        if valid >= expected:
            continue
        affected.add(req_id)
        _log_load_failure(state, request, block_ids[first], valid, output, policy)
        external = request.num_external_computed_tokens
        if external:  # only what really loaded counts as the connector's
            served = request.num_cached_tokens if request.num_cached_tokens >= 0 else expected
            start = served - external  # where the connector's tokens began
            request.num_external_computed_tokens = max(0, min(external, valid - start))
        if policy.load_failure_policy == "fail":
            error = f"KV of block {block_ids[first]} failed to load (load_failure_policy=fail)"
            state.finish(request, RequestStatus.FINISHED_ERROR, error)
            outputs.append(make_output(request, ()))
        elif parked:
            state.async_loads[req_id] = valid
        else:
            state.kv.truncate(request, valid)
            request.num_computed_tokens = valid
        if request.num_cached_tokens > valid:  # only what really loaded was served
            request.num_cached_tokens = valid
    return affected


def _log_load_failure(
    state: SchedulerState,
    request: Request,
    block_id: int,
    valid: int,
    output: FanInOutput,
    policy: UpdatePolicy,
) -> None:
    """Count a request whose KV failed to load under its first failed block's cause;
    the first of a cause is a warning, the rest debug records with the count (the
    server's ``kvstep_kv_load_failures_total`` counts the blocks)."""
    cause = str(output.load_failures.cause_of(block_id))
    count = state.load_failures.get(cause, 0) + 1
    state.load_failures[cause] = count
    level = log.warning if count == 1 else log.debug
    level(
        "KV load failed",
        req_id=request.request_id,
        block_id=block_id,
        cause=cause,
        valid_tokens=valid,
        policy=policy.load_failure_policy,
        failures=count,
        **({"later": "logged at debug level, counted by cause"} if count == 1 else {}),
    )


def _finish_recving(state: SchedulerState, finished_recving: frozenset[str]) -> None:
    """Parked requests whose async load completed become schedulable (``WAITING``)."""
    for req_id in sorted(finished_recving):
        request = state.requests.get(req_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            log.debug("finished_recving of a request not waiting for KV dropped", req_id=req_id)
            continue
        # Leave at least the last token to compute: its logits give the next token.
        num_computed = min(state.async_loads.pop(req_id), request.num_tokens - 1)
        request.num_computed_tokens = num_computed
        state.kv.cache_blocks(request, num_computed)
        request.status = RequestStatus.WAITING


def _finish_sending(state: SchedulerState, output: FanInOutput) -> None:
    """Free the blocks of finished requests whose KV was sent, or whose save failed.

    In a step where a save-side call raised, a request that holds no delayed blocks
    (it is still running) gets a debug record only: its tokens stand, only caching
    failed, and the raise is logged once per cause by :func:`_log_save_failures`."""
    for req_id in sorted(output.finished_sending):
        if not state.release_delayed(req_id):
            log.debug("finished_sending of an unknown request dropped", req_id=req_id)
    if output.save_failures:
        _log_save_failures(state, output)
    for req_id in sorted(output.failed_save_req_ids):
        released = state.release_delayed(req_id)
        level = log.debug if output.save_failures and not released else log.warning
        level("KV save failed", req_id=req_id, blocks_released=released)


def _log_save_failures(state: SchedulerState, output: FanInOutput) -> None:
    """Count the step's save-side calls that raised, by cause; the first of a cause is a
    warning (with one of its errors), the rest debug records with the count (the server's
    ``kvstep_kv_save_failures_total`` counts them too)."""
    failures = output.save_failures
    for cause, n in sorted(failures.counts.items()):
        count = state.save_failures.get(str(cause), 0) + n
        first = count == n
        state.save_failures[str(cause)] = count
        level = log.warning if first else log.debug
        level(
            "KV save-side connector call failed; the step's blocks are not cached",
            step_id=output.step_id,
            cause=str(cause),
            error=failures.errors.get(cause),
            failures=count,
            **({"later": "logged at debug level, counted by cause"} if first else {}),
        )


def _expire_transfers(
    state: SchedulerState, output: FanInOutput, outputs: list[RequestOutput]
) -> None:
    """Transfers that some rank never reported within the lease: a send frees the
    delayed blocks (the request already finished for its caller); a load fails its
    parked request alone, naming the silent ranks, and frees its blocks."""
    for req_id in sorted(output.expired_sending):
        missing = list(output.missing_ranks.get(req_id, ()))
        if state.release_delayed(req_id):
            state.num_expired_sending += 1
            log.warning("KV send expired; blocks freed", req_id=req_id, missing_ranks=missing)
        else:
            log.debug("expired send of a request without delayed blocks dropped", req_id=req_id)
    for req_id in sorted(output.expired_recving):
        request = state.requests.get(req_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            log.debug("expired load of a request not waiting for KV dropped", req_id=req_id)
            continue
        missing = list(output.missing_ranks.get(req_id, ()))
        error = (
            f"step {output.step_id}: KV load of {req_id!r} never completed on "
            f"rank(s) {', '.join(map(str, missing))} within the transfer lease"
        )
        state.num_expired_recving += 1
        log.warning("KV load expired; request failed", req_id=req_id, missing_ranks=missing)
        state.finish(request, RequestStatus.FINISHED_ERROR, error)
        outputs.append(make_output(request, ()))
