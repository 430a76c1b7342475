"""The runner hands the finalizers of a failed step the body's report (issue 11: the
engine's failure path is a finalizer that names the stage that failed)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

from pipeline.errors import StageError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StepReport
from pipeline.kernel.stage import Finalizer


@attrs.frozen
class _Raises:
    name: ClassVar[str] = "boom"
    requires: ClassVar[tuple[type, ...]] = ()
    provides: ClassVar[None] = None

    async def run(self, ctx: StepContext) -> None:
        raise StageError("boom", ctx.step_id, "injected")


@attrs.frozen
class _Ok:
    name: ClassVar[str] = "fine"
    requires: ClassVar[tuple[type, ...]] = ()
    provides: ClassVar[None] = None

    async def run(self, ctx: StepContext) -> None:
        return None


@attrs.frozen
class _Peek(Finalizer):
    """Keeps the report it sees while it runs."""

    name: ClassVar[str] = "peek"
    seen: list[StepReport | None] = attrs.field(factory=list, eq=False)

    def finalize(self, ctx: StepContext) -> None:
        self.seen.append(ctx.report)


@pytest.mark.anyio
class TestBodyReportForFinalizers:
    async def test_a_failed_body_is_reported_before_the_finalizers_run(self) -> None:
        """The finalizer sees the failed stage and no finalizer record; the final report
        replaces it."""
        peek = _Peek()
        ctx = StepContext(1)
        with pytest.raises(StageError):
            await StepGraph([_Raises(), peek]).run(ctx)
        (seen,) = peek.seen
        assert seen is not None and seen.failed_stage == "boom" and seen.outcome == "error"
        assert [r.name for r in seen.stages] == ["boom"]
        assert ctx.report is not None and ctx.report is not seen
        assert [r.name for r in ctx.report.stages] == ["boom", "peek"]

    async def test_no_report_before_the_finalizers_of_a_step_that_succeeded(self) -> None:
        """On success the finalizers see no report yet (the fast path builds one, at the end)."""
        peek = _Peek()
        ctx = StepContext(2)
        await StepGraph([_Ok(), peek]).run(ctx)
        assert peek.seen == [None] and ctx.report is not None and ctx.report.ok
