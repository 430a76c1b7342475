"""The engine step's record in the step log (:class:`~pipeline.steplog.StepLog`): what
the step scheduled, merged and finished, and the finished requests' times."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pipeline.artifacts import DraftsProposed, EngineStepOutput, FanInOutput, SchedulerOutput
from pipeline.kernel.context import StepContext
from pipeline.request import RequestOutput
from pipeline.steplog import StepLog
from stages.schedule import StepLink

__all__ = ["record_engine_step"]


def record_engine_step(step_log: StepLog, ctx: StepContext) -> None:
    """Record the engine step of ``ctx`` (its report must be set) in ``step_log``."""
    assert ctx.report is not None
    so = ctx.maybe(SchedulerOutput)
    merged = ctx.maybe(FanInOutput)
    out = ctx.maybe(EngineStepOutput)
    finished = [o.request_id for o in out.outputs if o.finished] if out is not None else []
    request_times = _request_times(out.outputs) if finished and out is not None else {}
    stats = out.stats if out is not None else None
    ahead: dict[str, float] = {}
    link = ctx.maybe(StepLink)
    if link is not None:  # async scheduling: how long schedule waited for the step before
        ahead["waited_for_previous_ms"] = round(link.waited_s * 1e3, 3)
    step_log.record_step(
        ctx.report,
        kind="engine",
        scheduler_step_id=so.step_id if so is not None else None,
        batch_size=len(so.requests) if so is not None else 0,
        requests=[r.req_id for r in so.requests] if so is not None else [],
        num_tokens=so.total_num_scheduled_tokens if so is not None else 0,
        loaded_tokens=stats.loaded_tokens if stats else 0,
        loaded_bytes=stats.loaded_bytes if stats else 0,
        saved_tokens=stats.saved_tokens if stats else 0,
        saved_bytes=stats.saved_bytes if stats else 0,
        finished=finished,
        request_times=request_times,
        load_error_blocks=len(merged.invalid_block_ids) if merged is not None else 0,
        failed_save_requests=sorted(merged.failed_save_req_ids) if merged is not None else [],
        **ahead,
        **_load_failures(merged),
        **_save_failures(merged),
        **_spec_decode(out),
        **_without_drafts(ctx.maybe(DraftsProposed)),
    )


def _without_drafts(proposed: DraftsProposed | None) -> dict[str, Any]:
    """``{"spec_without_drafts": {reason: requests}}`` when requests started decoding
    without drafts in this step, and ``spec_proposer_failures`` when the proposer raised;
    else nothing (``/metrics`` adds them up)."""
    fields: dict[str, Any] = {}
    if proposed is not None and proposed.without_drafts:
        fields["spec_without_drafts"] = dict(sorted(proposed.without_drafts.items()))
    if proposed is not None and proposed.proposer_failures:
        fields["spec_proposer_failures"] = proposed.proposer_failures
    return fields


def _spec_decode(out: EngineStepOutput | None) -> dict[str, Any]:
    """The step's speculative decoding counts (``spec_drafts``, ``spec_draft_tokens``,
    ``spec_accepted_tokens``, ``spec_accepted_per_position``) when requests had drafts
    verified, else nothing; ``/metrics`` and ``kvstep logs`` add them up."""
    spec = out.spec_decode if out is not None else None
    if spec is None:
        return {}
    return {
        "spec_drafts": spec.num_drafts,
        "spec_draft_tokens": spec.num_draft_tokens,
        "spec_accepted_tokens": spec.num_accepted_tokens,
        "spec_accepted_per_position": list(spec.accepted_per_position),
    }


def _load_failures(merged: FanInOutput | None) -> dict[str, dict[str, int]]:
    """``{"load_failures": {cause: blocks}}`` for a step with load errors (``unknown``:
    no cause named), else nothing; the server's ``kvstep_kv_load_failures_total`` adds
    them up."""
    if merged is None or not merged.invalid_block_ids:
        return {}
    counts = merged.load_failures.count(merged.invalid_block_ids)
    return {"load_failures": {str(cause): n for cause, n in sorted(counts.items())}}


def _save_failures(merged: FanInOutput | None) -> dict[str, dict[str, int]]:
    """``{"kv_save_failures": {cause: calls}}`` for a step in which a save-side connector
    call raised on some rank (summed over ranks), else nothing; the server's
    ``kvstep_kv_save_failures_total`` adds them up."""
    if merged is None or not merged.save_failures:
        return {}
    counts = merged.save_failures.counts
    return {"kv_save_failures": {str(cause): n for cause, n in sorted(counts.items())}}


def _request_times(outputs: Iterable[RequestOutput]) -> dict[str, list[float | None]]:
    """``{req_id: [arrival, first_scheduled, first_token]}`` as unix times, for the
    finished ``outputs`` (the step log's ``request_times``; the trace starts request
    spans at arrival from it)."""
    offset = time.time() - time.monotonic()
    times: dict[str, list[float | None]] = {}
    for out in outputs:
        m = out.metrics
        if not out.finished or m is None:
            continue
        times[out.request_id] = [
            None if t is None else round(t + offset, 6)
            for t in (m.arrival_time, m.first_scheduled_time, m.first_token_time)
        ]
    return times
