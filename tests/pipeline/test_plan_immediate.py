"""Immediate stages: a parallel block runs them first, in series, and needs no task group."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import attrs
import pytest

from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.plan import Parallel, inline_immediate
from pipeline.kernel.stage import Finalizer, is_immediate


class In:
    pass


class A:
    pass


class B:
    pass


class C:
    pass


@attrs.frozen
class Make:
    name: str
    requires: tuple[type, ...]
    provides: type
    immediate: bool = False
    fail: bool = False
    log: list[str] = attrs.field(factory=list, eq=False)

    async def run(self, ctx: StepContext) -> Any:
        if not self.immediate:
            await anyio.lowlevel.checkpoint()
        self.log.append(self.name)
        if self.fail:
            raise ValueError(self.name)
        return self.provides()


@attrs.frozen
class Clear(Finalizer):
    name: ClassVar[str] = "clear"
    log: list[str] = attrs.field(factory=list, eq=False)

    def finalize(self, ctx: StepContext) -> None:
        self.log.append("clear")


def graph(log: list[str], *, immediate: bool, fail: bool = False) -> StepGraph:
    return StepGraph(
        [
            Make("a", (In,), A, log=log),
            Make("b", (A,), B, immediate=immediate, fail=fail, log=log),
            Make("c", (A,), C, log=log),
            Clear(log=log),
        ],
        inputs=(In,),
    )


def run(g: StepGraph) -> StepContext:
    ctx = StepContext(1, inputs=(In(),))

    async def main() -> None:
        await g.run(ctx)

    anyio.run(main)
    return ctx


class TestImmediate:
    def test_flag_is_read_from_the_stage(self) -> None:
        """``immediate`` is optional and means True only when it is True."""
        assert is_immediate(Make("b", (), B, immediate=True))
        assert not is_immediate(Make("b", (), B))
        assert not is_immediate(object())

    def test_a_block_with_one_waiting_branch_becomes_a_series(self) -> None:
        """{b | c} with b immediate runs as b → c; the printed graph keeps the block."""
        g = graph([], immediate=True)
        assert g._plan.run_body == (0, 1, 2)
        assert str(g) == "a → {b | c} ⟂ clear"

    def test_other_blocks_keep_their_task_group(self) -> None:
        """Only immediate branches leave a block; two waiting branches stay parallel."""
        assert inline_immediate((0, Parallel((1, 2, 3))), {2}) == (0, 2, Parallel((1, 3)))
        assert inline_immediate((Parallel((1, 2)),), set()) == (Parallel((1, 2)),)

    def test_the_immediate_branch_runs_first_and_the_finalizer_last(self) -> None:
        log: list[str] = []
        ctx = run(graph(log, immediate=True))
        assert log == ["a", "b", "c", "clear"]
        assert ctx.report is not None and ctx.report.outcome == "ok"
        assert [s.name for s in ctx.report.stages] == ["a", "b", "c", "clear"]

    def test_a_failing_immediate_stage_fails_the_step_and_the_finalizer_runs(self) -> None:
        log: list[str] = []
        with pytest.raises(ValueError, match="b"):
            run(graph(log, immediate=True, fail=True))
        assert log == ["a", "b", "clear"]
