"""The step runner: walks a graph's precomputed plan, then runs every finalizer.

Body: a series is awaited stage by stage in the current task (no task, no scheduling
hop); only a :class:`~pipeline.kernel.plan.Parallel` (with more than one branch that
may wait: the plan runs ``immediate`` stages first, in series) or
:class:`~pipeline.kernel.plan.Dataflow` block opens an anyio task group. Each stage's
result is checked against its ``provides`` and stored in the context. If a stage raises,
its task group cancels the rest.

Finalizers then run, always (success, error, cancellation, timeout), in reverse order,
each isolated from the others' failures::

    try:
        try:
            with anyio.move_on_after(f.timeout_s, shield=True):
                await f.run(ctx)        # skipped when f does not override Finalizer.run
        finally:
            f.finalize(ctx)             # synchronous, innermost finally
    except BaseException as exc:        # recorded; the next finalizer runs
        ...

Afterwards the body's own error is re-raised, unmasked (a cancellation stays a
cancellation). If only finalizers failed: :class:`~pipeline.errors.FinalizerError`; if a
finalizer was interrupted by a cancellation (a second native ``task.cancel()``), that
cancellation is re-raised. The runner does not log; the step log reads the report.
"""

from __future__ import annotations

import time
from time import perf_counter_ns as _now

import anyio

from pipeline.errors import FinalizerError, GraphError, StageError
from pipeline.kernel.context import StepContext
from pipeline.kernel.plan import Dataflow, Fused, Item, Parallel, StepPlan
from pipeline.kernel.report import StageOutcome, StageRecord, StepOutcome, StepReport
from pipeline.kernel.validate import type_name

__all__ = ["StageRecord", "StepPlan", "StepReport", "run_step"]

_NS = 1e-9


class _Step:
    """Mutable per-step bookkeeping shared by the body's tasks (one event loop)."""

    __slots__ = ("artifacts", "cancel", "ctx", "ends", "excs", "plan", "starts")

    def __init__(self, plan: StepPlan, ctx: StepContext, size: int) -> None:
        self.plan = plan
        self.cancel: BaseException | None = None  # a cancellation that ended a stage
        self.ctx = ctx
        self.artifacts = ctx._artifacts
        self.starts = [0] * size
        self.ends = [0] * size
        self.excs: list[BaseException | None] = [None] * size


async def _run_series(items: tuple[Item, ...], st: _Step) -> None:
    plan, ctx, artifacts, starts, ends = st.plan, st.ctx, st.artifacts, st.starts, st.ends
    runs, provides = plan.runs, plan.provides
    i = -1
    try:
        for item in items:
            if type(item) is int:
                i = item
                starts[i] = _now()
                value = await runs[i](ctx)
                ends[i] = _now()
                out = provides[i]
                if out is not None:
                    if not isinstance(value, out):
                        raise _wrong_type(plan.names[i], ctx.step_id, out, value)
                    artifacts[out] = value
                i = -1
            elif type(item) is Parallel:
                await _run_parallel(item, st)
            elif type(item) is Dataflow:
                await _run_dataflow(item, st)
            elif type(item) is Fused:
                await _run_fused(item, st)
            else:
                await _run_series(item, st)  # type: ignore[arg-type]
    except BaseException as exc:
        if i >= 0:
            if not ends[i]:
                ends[i] = _now()
            st.excs[i] = exc
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                st.cancel = exc
        raise


def _wrong_type(name: str, step_id: int, out: type, value: object) -> StageError:
    return StageError(
        name,
        step_id,
        f"returned {type(value).__qualname__}, but it declares provides={type_name(out)}",
    )


async def _run_fused(block: Fused, st: _Step) -> None:
    """Run a fused block's ``compute`` methods in a row in one hand-over (on the loop
    when no member has a ``hop``); each member keeps its own times and outcome."""
    plan, ctx, artifacts, starts, ends = st.plan, st.ctx, st.artifacts, st.starts, st.ends
    computes, provides, names = plan.computes, plan.provides, plan.names
    current = [-1]

    def work() -> None:
        for i in block.members:
            current[0] = i
            starts[i] = _now()
            value = computes[i](ctx)  # type: ignore[misc]
            ends[i] = _now()
            out = provides[i]
            if out is not None:
                if not isinstance(value, out):
                    raise _wrong_type(names[i], ctx.step_id, out, value)
                artifacts[out] = value
        current[0] = -1

    try:
        if block.hop is None:
            work()
        else:
            await plan.hops[block.hop](ctx, work)  # type: ignore[misc]
    except BaseException as exc:
        i = current[0] if current[0] >= 0 else block.members[0]
        if not starts[i]:
            starts[i] = _now()
        if not ends[i]:
            ends[i] = _now()
        st.excs[i] = exc
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            st.cancel = exc
        raise


async def _run_item(item: Item, st: _Step) -> None:
    await _run_series(item if isinstance(item, tuple) else (item,), st)


async def _run_parallel(block: Parallel, st: _Step) -> None:
    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            for branch in block.branches[1:]:
                tg.start_soon(_run_item, branch, st, name="kvstep-branch")
            await _run_item(block.branches[0], st)
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
    if error is not None:
        raise error  # outside the handler: the stage's exception keeps its own context
    _reraise_swallowed_cancel(st)


async def _run_dataflow(block: Dataflow, st: _Step) -> None:
    done = {m: anyio.Event() for m in block.members}

    async def member(i: int, waits: tuple[int, ...]) -> None:
        for w in waits:
            await done[w].wait()
        await _run_series((i,), st)
        done[i].set()

    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            for i, waits in zip(block.members, block.waits, strict=True):
                tg.start_soon(member, i, waits, name="kvstep-stage")
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
    if error is not None:
        raise error
    _reraise_swallowed_cancel(st)


def _reraise_swallowed_cancel(st: _Step) -> None:
    """Re-raise a stage's cancellation that its block's task group swallowed.

    A native ``task.cancel()`` of a stage's task ends that task with the cancellation;
    anyio's task group then cancels the sibling stages and exits *normally*. The block
    did not complete, so the body ends cancelled, as it would had the stage run in the
    step's own task. (A cancellation from an enclosing scope never gets here: the task
    group re-raises it itself.)
    """
    if st.cancel is not None:
        raise st.cancel


async def run_step(plan: StepPlan, ctx: StepContext) -> StepReport:
    """Run one step of a planned graph; see the module docstring for the contract.

    Called by :meth:`StepGraph.run`, on the event loop (asyncio or trio via anyio). The
    report is stored in ``ctx.report`` in every case; ``ctx.error``/``ctx.cancelled``
    are set before the finalizers run, and when the body failed ``ctx.report`` then
    already holds the body's report (its stage records, no finalizer's yet), so that a
    finalizer can tell which stage failed. Cancellation-safe: cancelling the caller cancels
    the body, still runs every finalizer, and re-raises the cancellation.
    """
    n = len(plan.names)
    st = _Step(plan, ctx, n + len(plan.finalizers))
    start_ts = time.time()
    t0 = _now()
    body_exc: BaseException | None = None
    try:
        for t in plan.inputs:
            if t not in st.artifacts:
                raise GraphError(
                    f"step {ctx.step_id}: the graph needs input {type_name(t)}, which the "
                    "context does not hold; pass it in StepContext(inputs=...)",
                    artifact=type_name(t),
                )
        await _run_series(plan.run_body, st)
    except BaseException as exc:
        body_exc = exc
        ctx.error = exc
        ctx.cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        # The finalizers may ask which stage failed (the engine's failure path does).
        ctx.report = _report(plan, ctx, st, t0, start_ts, body_exc, {}, body_only=True)

    starts, ends, excs = st.starts, st.ends, st.excs
    cut: dict[int, float] = {}
    for j, fin in enumerate(plan.finalizers, n):
        starts[j] = _now()
        try:
            try:
                if fin.drain is not None:
                    with anyio.move_on_after(fin.timeout_s, shield=True) as scope:
                        await fin.drain(ctx)
                    if scope.cancelled_caught:
                        cut[j] = fin.timeout_s
            finally:
                fin.finalize(ctx)
        except BaseException as exc:
            excs[j] = exc
        ends[j] = _now()

    report = _report(plan, ctx, st, t0, start_ts, body_exc, cut)
    ctx.report = report
    if body_exc is not None:
        raise body_exc
    fin_excs = excs[n:]
    for fin_exc in fin_excs:
        if fin_exc is not None and not isinstance(fin_exc, Exception):
            raise fin_exc  # a cancellation (or KeyboardInterrupt) that hit a finalizer
    if report.finalizer_failures:
        raise FinalizerError(
            ctx.step_id,
            {f.name: e for f, e in zip(plan.finalizers, fin_excs, strict=True) if e is not None},
        )
    return report


def _report(
    plan: StepPlan,
    ctx: StepContext,
    st: _Step,
    t0: int,
    start_ts: float,
    body_exc: BaseException | None,
    cut: dict[int, float],
    *,
    body_only: bool = False,
) -> StepReport:
    starts, ends, excs = st.starts, st.ends, st.excs
    n = len(plan.names)
    if body_exc is None and not cut and not any(excs):
        # Fast path (every stage ran and succeeded): one tuple per stage, no branches.
        names, new = plan.names, tuple.__new__
        records = [
            new(StageRecord, (names[j], "ok", (starts[j] - t0) * _NS, (ends[j] - starts[j]) * _NS,
                              False, None))
            for j in plan.order
        ]  # fmt: skip
        records += [
            new(StageRecord, (f.name, "ok", (starts[j] - t0) * _NS, (ends[j] - starts[j]) * _NS,
                              True, None))
            for j, f in enumerate(plan.finalizers, n)
        ]  # fmt: skip
        return StepReport(
            step_id=ctx.step_id,
            rank=ctx.rank,
            outcome="ok",
            duration_s=(_now() - t0) * _NS,
            stages=tuple(records),
            failed_stage=None,
            finalizer_failures=(),
            start_ts=start_ts,
        )
    cancel_cls = anyio.get_cancelled_exc_class()
    records = []
    failed: tuple[int, str] | None = None
    failures: list[str] = []
    for j in plan.order if body_only else (*plan.order, *range(n, len(starts))):
        is_fin = j >= n
        name = plan.finalizers[j - n].name if is_fin else plan.names[j]
        exc = excs[j]
        error: str | None = None
        outcome: StageOutcome
        if not starts[j]:
            outcome = "skipped"
        elif exc is None:
            outcome = "ok"
            if j in cut:
                outcome, error = "cancelled", f"drain cut after timeout_s={cut[j]:g}"
        elif isinstance(exc, cancel_cls):
            outcome = "cancelled"
        else:
            outcome, error = "error", f"{type(exc).__name__}: {exc}"
            if is_fin:
                if isinstance(exc, Exception):
                    failures.append(name)
            elif failed is None or ends[j] < ends[failed[0]]:
                failed = (j, name)
        records.append(
            StageRecord(
                name=name,
                outcome=outcome,
                start_s=(starts[j] - t0) * _NS if starts[j] else 0.0,
                duration_s=(ends[j] - starts[j]) * _NS if starts[j] else 0.0,
                finalizer=is_fin,
                error=error,
            )
        )
    step_outcome: StepOutcome
    if body_exc is None:
        step_outcome = "ok"
    elif ctx.cancelled:
        step_outcome = "cancelled"
    else:
        step_outcome = "error"
    return StepReport(
        step_id=ctx.step_id,
        rank=ctx.rank,
        outcome=step_outcome,
        duration_s=(_now() - t0) * _NS,
        stages=tuple(records),
        failed_stage=failed[1] if failed is not None else None,
        finalizer_failures=tuple(failures),
        start_ts=start_ts,
    )
