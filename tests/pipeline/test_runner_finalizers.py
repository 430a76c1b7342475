"""The runner: finalizers on every path, error propagation, cancellation, the report."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import anyio
import attrs
import pytest

from pipeline.errors import FinalizerError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StepReport
from pipeline.kernel.stage import Finalizer


class A:
    pass


class B:
    pass


class C:
    pass


class Boom(Exception):
    """The error a failing stage raises."""


@attrs.frozen
class Work:
    """A body stage: logs, optionally sleeps (``math.inf``: hangs), optionally raises."""

    name: str
    requires: tuple[type, ...]
    provides: type | None
    log: list[str] = attrs.field(eq=False)
    delay: float = 0.0
    error: BaseException | None = None

    async def run(self, ctx: StepContext) -> Any:
        self.log.append(f"{self.name}.start")
        if self.delay:
            await anyio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        self.log.append(f"{self.name}.end")
        return self.provides() if self.provides is not None else None


@attrs.frozen
class Fin(Finalizer):
    """A finalizer that logs its drain and finalize and what it saw of the body."""

    name: str
    log: list[str] = attrs.field(eq=False)
    drain_s: float = 0.0
    drain_error: BaseException | None = None
    finalize_error: BaseException | None = None
    timeout_s: float = 2.0
    started: asyncio.Event | None = attrs.field(default=None, eq=False)

    async def run(self, ctx: StepContext) -> None:
        self.log.append(f"{self.name}.drain")
        if self.started is not None:
            self.started.set()
        if self.drain_s:
            await anyio.sleep(self.drain_s)
        if self.drain_error is not None:
            raise self.drain_error
        self.log.append(f"{self.name}.drained")

    def finalize(self, ctx: StepContext) -> None:
        self.log.append(f"{self.name}.finalize")
        ctx.scratch.setdefault("seen", []).append((self.name, ctx.error, ctx.cancelled))
        if self.finalize_error is not None:
            raise self.finalize_error


def graph(
    log: list[str], *, fail: str | None = None, hang: str | None = None, **fins: Any
) -> StepGraph:
    """a → {b | c}, then finalizers f1, f2 (so f2 runs first)."""

    def work(name: str, requires: tuple[type, ...], provides: type | None) -> Work:
        return Work(
            name,
            requires,
            provides,
            log,
            delay=math.inf if name == hang else 0.0,
            error=Boom(name) if name == fail else None,
        )

    return StepGraph(
        [
            work("a", (), A),
            work("b", (A,), B),
            work("c", (A,), C),
            Fin("f1", log, **fins.get("f1", {})),
            Fin("f2", log, **fins.get("f2", {})),
        ]
    )


def finalizer_calls(log: list[str]) -> list[str]:
    return [entry for entry in log if entry.startswith("f")]


class TestFinalizersAlwaysRun:
    def test_on_success_in_reverse_order(self) -> None:
        """On success both finalizers drain and finalize, the last declared first."""
        log: list[str] = []
        ctx = StepContext(1)
        report = anyio.run(graph(log).run, ctx)
        assert finalizer_calls(log) == [
            "f2.drain", "f2.drained", "f2.finalize", "f1.drain", "f1.drained", "f1.finalize"
        ]  # fmt: skip
        assert report.outcome == "ok" and report.ok
        assert ctx.error is None and ctx.cancelled is False

    def test_on_error_original_error_reraised(self) -> None:
        """A failing stage's own exception propagates, after every finalizer ran."""
        log: list[str] = []
        ctx = StepContext(1)
        with pytest.raises(Boom, match="b") as info:
            anyio.run(graph(log, fail="b").run, ctx)
        assert finalizer_calls(log)[-1] == "f1.finalize" and "f2.finalize" in log
        assert ctx.error is info.value
        assert ctx.scratch["seen"] == [("f2", info.value, False), ("f1", info.value, False)]

    def test_parallel_failure_is_unwrapped_and_sibling_cancelled(self) -> None:
        """A stage failing inside a task group surfaces as itself, not an ExceptionGroup."""
        log: list[str] = []
        ctx = StepContext(1)
        with pytest.raises(Boom):
            anyio.run(graph(log, fail="c", hang="b").run, ctx)
        assert ctx.report is not None
        outcomes = {r.name: r.outcome for r in ctx.report.stages}
        assert outcomes == {"a": "ok", "b": "cancelled", "c": "error", "f2": "ok", "f1": "ok"}
        assert ctx.report.failed_stage == "c"

    def test_later_stages_are_skipped(self) -> None:
        """Stages after a failure never start and are reported as skipped."""
        log: list[str] = []
        ctx = StepContext(1)
        with pytest.raises(Boom):
            anyio.run(graph(log, fail="a").run, ctx)
        assert ctx.report is not None
        assert [r.outcome for r in ctx.report.stages[:3]] == ["error", "skipped", "skipped"]
        assert "b.start" not in log

    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_on_cancellation(self, backend: str) -> None:
        """Cancelling the step runs every finalizer, and the cancellation propagates."""
        log: list[str] = []
        ctx = StepContext(1)

        async def main() -> bool:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(graph(log, hang="b").run, ctx)
                    await anyio.sleep(0.05)
                    scope.cancel()
            return scope.cancelled_caught

        assert anyio.run(main, backend=backend) is True
        assert "f2.finalize" in log and "f1.finalize" in log
        assert ctx.cancelled is True
        assert ctx.report is not None and ctx.report.outcome == "cancelled"
        assert ctx.report.failed_stage is None

    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_on_timeout(self, backend: str) -> None:
        """An enclosing fail_after cancels the body; finalizers run; TimeoutError surfaces."""
        log: list[str] = []
        ctx = StepContext(1)

        async def main() -> None:
            with anyio.fail_after(0.05):
                await graph(log, hang="c").run(ctx)

        with pytest.raises(TimeoutError):
            anyio.run(main, backend=backend)
        assert finalizer_calls(log)[-1] == "f1.finalize"
        assert ctx.report is not None and ctx.report.outcome == "cancelled"

    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_drain_is_shielded_from_the_step_cancellation(self, backend: str) -> None:
        """An awaiting drain completes although the step was cancelled."""
        log: list[str] = []
        ctx = StepContext(1)

        async def main() -> None:
            with anyio.move_on_after(0.05):
                await graph(log, hang="b", f1={"drain_s": 0.05}).run(ctx)

        anyio.run(main, backend=backend)
        assert "f1.drained" in log


class TestFinalizerFailures:
    def test_failing_finalize_does_not_stop_the_others(self) -> None:
        """A finalizer whose finalize raises is reported; the next one still runs."""
        log: list[str] = []
        ctx = StepContext(1)
        err = RuntimeError("clear failed")
        with pytest.raises(FinalizerError, match="f2") as info:
            anyio.run(graph(log, f2={"finalize_error": err}).run, ctx)
        assert info.value.failures == {"f2": err}
        assert "f1.finalize" in log
        assert ctx.report is not None and ctx.report.finalizer_failures == ("f2",)
        assert ctx.report.outcome == "ok" and not ctx.report.ok

    def test_failing_drain_still_finalizes(self) -> None:
        """A drain that raises is followed by its own finalize and the other finalizers."""
        log: list[str] = []
        ctx = StepContext(1)
        with pytest.raises(FinalizerError):
            anyio.run(graph(log, f2={"drain_error": RuntimeError("drain")}).run, ctx)
        assert finalizer_calls(log) == [
            "f2.drain", "f2.finalize", "f1.drain", "f1.drained", "f1.finalize"
        ]  # fmt: skip
        assert ctx.report is not None
        assert ctx.report.stage("f2").error == "RuntimeError: drain"

    def test_body_error_not_masked_by_finalizer_error(self) -> None:
        """With both a body and a finalizer failure, the body's error is raised."""
        log: list[str] = []
        ctx = StepContext(1)
        with pytest.raises(Boom):
            anyio.run(graph(log, fail="a", f1={"finalize_error": RuntimeError("x")}).run, ctx)
        assert ctx.report is not None
        assert ctx.report.finalizer_failures == ("f1",)
        assert ctx.report.outcome == "error" and ctx.report.failed_stage == "a"

    def test_hanging_drain_is_cut_at_timeout(self) -> None:
        """A drain that never ends is cut after timeout_s; finalize runs; the step succeeds."""
        log: list[str] = []
        ctx = StepContext(1)
        report = anyio.run(graph(log, f2={"drain_s": math.inf, "timeout_s": 0.05}).run, ctx)
        assert "f2.finalize" in log and "f2.drained" not in log and "f1.finalize" in log
        record = report.stage("f2")
        assert record.outcome == "cancelled" and record.error is not None
        assert "timeout_s=0.05" in record.error
        assert 0.04 < record.duration_s < 1.0


class TestNativeCancellation:
    @pytest.mark.asyncio
    async def test_second_cancel_during_drain_still_finalizes_all(self) -> None:
        """Cancel once in the body, again in a drain: every finalize() runs, cancel propagates."""
        log: list[str] = []
        started = asyncio.Event()
        g = graph(log, hang="b", f2={"drain_s": 10.0, "started": started})
        ctx = StepContext(1)
        task = asyncio.create_task(g.run(ctx))
        await asyncio.sleep(0.02)
        task.cancel()  # first: cancels the body
        await asyncio.wait_for(started.wait(), 2)
        task.cancel()  # second: gets through the anyio shield of f2's drain
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        assert "f2.finalize" in log and "f1.finalize" in log and "f1.drained" in log
        assert "f2.drained" not in log
        assert ctx.report is not None and ctx.report.outcome == "cancelled"
        assert ctx.report.stage("f2").outcome == "cancelled"

    @pytest.mark.asyncio
    async def test_two_cancels_in_a_row_during_drain(self) -> None:
        """Two task.cancel() calls in a row during a drain: all finalize() run, task cancelled."""
        log: list[str] = []
        started = asyncio.Event()
        g = graph(log, f2={"drain_s": 10.0, "started": started})
        ctx = StepContext(1)
        task = asyncio.create_task(g.run(ctx))
        await asyncio.wait_for(started.wait(), 2)
        task.cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        assert "f2.finalize" in log and "f1.finalize" in log
        assert ctx.report is not None
        assert ctx.report.outcome == "ok"  # the body had finished
        assert ctx.report.stage("f2").outcome == "cancelled"


class TestStepReport:
    def test_success_report(self) -> None:
        """The report lists body stages in dataflow order, then finalizers as they ran."""
        log: list[str] = []
        ctx = StepContext(7, rank=2)
        report = anyio.run(graph(log).run, ctx)
        assert isinstance(report, StepReport) and ctx.report is report
        assert (report.step_id, report.rank) == (7, 2)
        assert [r.name for r in report.stages] == ["a", "b", "c", "f2", "f1"]
        assert [r.finalizer for r in report.stages] == [False, False, False, True, True]
        assert all(r.outcome == "ok" and r.error is None for r in report.stages)
        assert all(r.duration_s >= 0 and r.start_s >= 0 for r in report.stages)
        starts = [r.start_s for r in report.stages]
        assert starts[0] <= starts[1] and starts[3] <= starts[4]
        assert report.duration_s >= starts[-1] + report.stages[-1].duration_s
        assert report.failed_stage is None and report.finalizer_failures == ()
        assert report.start_ts > 1e9

    def test_error_report_is_stored_although_run_raises(self) -> None:
        """When run() raises, ctx.report still holds the error and the failed stage."""
        log: list[str] = []
        ctx = StepContext(1)
        with pytest.raises(Boom):
            anyio.run(graph(log, fail="b").run, ctx)
        assert ctx.report is not None
        assert ctx.report.outcome == "error" and ctx.report.failed_stage == "b"
        assert ctx.report.stage("b").error == "Boom: b"

    def test_finalizer_only_graph(self) -> None:
        """A graph with no body stages still runs its finalizers."""
        log: list[str] = []
        report = anyio.run(StepGraph([Fin("only", log)]).run, StepContext(0))
        assert log == ["only.drain", "only.drained", "only.finalize"]
        assert [r.name for r in report.stages] == ["only"]
