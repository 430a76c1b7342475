"""Compute stages fuse into one hand-over; stages that require what they provide amend it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import anyio
import attrs
import pytest

from pipeline.errors import GraphError, StageError
from pipeline.kernel import StepContext, StepGraph
from pipeline.kernel.compute import ComputeStage

T = TypeVar("T")


@attrs.frozen
class A:
    trail: tuple[str, ...] = ()


@attrs.frozen
class B:
    trail: tuple[str, ...] = ()


@attrs.frozen
class C:
    trail: tuple[str, ...] = ()


class Thread:
    """A compute thread that counts its hand-overs and the threads work ran on."""

    def __init__(self) -> None:
        self.hops = 0
        self.threads: list[str] = []

    async def run(self, work: Callable[[], T]) -> T:
        self.hops += 1
        return await anyio.to_thread.run_sync(work)


@attrs.frozen
class Step(ComputeStage):
    """Reads ``reads`` (the trail of its first type), returns ``out`` with its name added."""

    name: str  # type: ignore[misc]
    requires: tuple[type, ...]  # type: ignore[misc]
    provides: type  # type: ignore[misc]
    thread: Thread | None = None
    fail: bool = False
    wrong: bool = False

    def compute(self, ctx: StepContext) -> Any:
        if self.thread is not None:
            self.thread.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        if self.wrong:
            return "not an artifact"
        trail: tuple[str, ...] = ()
        for t in self.requires:
            trail += ctx.get(t).trail
        return self.provides(trail=(*trail, self.name))

    async def hop(self, ctx: StepContext, work: Callable[[], T]) -> T:
        if self.thread is None:
            return work()
        return await self.thread.run(work)


@attrs.frozen
class OnLoop:
    """A plain stage on the event loop."""

    name: str
    requires: tuple[type, ...]
    provides: type

    async def run(self, ctx: StepContext) -> Any:
        trail: tuple[str, ...] = ()
        for t in self.requires:
            trail += ctx.get(t).trail
        return self.provides(trail=(*trail, self.name))


def _run(graph: StepGraph) -> StepContext:
    ctx = StepContext(step_id=1)

    async def main() -> None:
        await graph.run(ctx)

    anyio.run(main)
    return ctx


class TestFusion:
    def test_adjacent_compute_stages_run_in_one_hop(self) -> None:
        """Three compute stages in a row: one hand-over, on one worker thread, each stage
        with its own record in the report."""
        thread = Thread()
        graph = StepGraph(
            [
                Step("one", (), A, thread),
                Step("two", (A,), B, thread),
                Step("three", (B,), C, thread),
            ]
        )
        ctx = _run(graph)
        assert thread.hops == 1
        assert len(set(thread.threads)) == 1 and thread.threads[0] != "MainThread"
        assert ctx.get(C).trail == ("one", "two", "three")
        assert str(graph) == "one → two → three"
        assert ctx.report is not None
        records = {r.name: r for r in ctx.report.stages}
        assert all(records[n].outcome == "ok" for n in ("one", "two", "three"))
        assert records["two"].start_s >= records["one"].start_s + records["one"].duration_s

    def test_the_head_of_a_parallel_branch_joins_the_hop(self) -> None:
        """forward → {sample | save}: sample runs in forward's hand-over, save after it."""
        thread = Thread()
        graph = StepGraph(
            [
                Step("forward", (), A, thread),
                Step("sample", (A,), B, thread),
                OnLoop("save", (A,), C),
            ]
        )
        ctx = _run(graph)
        assert thread.hops == 1
        assert str(graph) == "forward → sample → save"
        assert ctx.get(B).trail == ("forward", "sample")
        assert ctx.get(C).trail == ("forward", "save")

    def test_a_loop_stage_between_splits_the_hop(self) -> None:
        """A stage on the event loop between two compute stages: two hand-overs."""
        thread = Thread()
        graph = StepGraph(
            [
                Step("one", (), A, thread),
                OnLoop("between", (A,), B),
                Step("three", (B,), C, thread),
            ]
        )
        _run(graph)
        assert thread.hops == 2

    def test_a_stage_without_hop_runs_in_its_neighbours_hop(self) -> None:
        """The block hands over with the first member's hop; a member without one (a
        user's stage) runs on the same thread."""
        thread = Thread()
        graph = StepGraph([Step("one", (), A, thread), Step("two", (A,), B, None)])
        ctx = _run(graph)
        assert thread.hops == 1 and ctx.get(B).trail == ("one", "two")

    def test_a_failing_member_is_the_failed_stage(self) -> None:
        """The member that raised is the step's failed stage; the ones after it are skipped."""
        thread = Thread()
        graph = StepGraph(
            [
                Step("one", (), A, thread),
                Step("two", (A,), B, thread, fail=True),
                Step("three", (B,), C, thread),
            ]
        )
        ctx = StepContext(step_id=1)

        async def main() -> None:
            await graph.run(ctx)

        with pytest.raises(RuntimeError, match="two failed"):
            anyio.run(main)
        assert ctx.report is not None and ctx.report.failed_stage == "two"
        outcomes = {r.name: r.outcome for r in ctx.report.stages}
        assert outcomes == {"one": "ok", "two": "error", "three": "skipped"}

    def test_a_member_returning_the_wrong_type_is_a_stage_error(self) -> None:
        """A fused member's artifact is type-checked like any stage's."""
        graph = StepGraph([Step("one", (), A, Thread()), Step("two", (A,), B, wrong=True)])
        with pytest.raises(StageError, match=r"'two'.*provides=B"):
            _run(graph)

    def test_a_compute_stage_with_an_async_compute_is_refused(self) -> None:
        """``compute`` runs on a thread, so it must be synchronous."""

        @attrs.frozen
        class Bad:
            name: ClassVar[str] = "bad"
            requires: ClassVar[tuple[type, ...]] = ()
            provides: ClassVar[type] = A
            runs_on: ClassVar[str] = "compute"

            async def compute(self, ctx: StepContext) -> A:
                return A()

            async def run(self, ctx: StepContext) -> A:
                return A()

        with pytest.raises(GraphError, match=r"'bad'.*must be a synchronous method"):
            StepGraph([Bad()])


class TestAmenders:
    def test_amenders_run_in_declaration_order_and_consumers_read_the_last(self) -> None:
        """Two stages that require and provide B run after B's provider, in declaration
        order; a stage requiring B reads the second's."""
        graph = StepGraph(
            [
                OnLoop("make", (), B),
                OnLoop("read", (B,), C),
                OnLoop("first", (B,), B),
                OnLoop("second", (B,), B),
            ]
        )
        ctx = _run(graph)
        assert ctx.get(C).trail == ("make", "first", "second", "read")
        assert str(graph) == "make → first → second → read"

    def test_insert_after_places_an_amender_in_the_chain(self) -> None:
        """insert_after("first", x) puts x between first and second."""
        graph = StepGraph(
            [OnLoop("make", (), B), OnLoop("first", (B,), B), OnLoop("second", (B,), B)]
        )
        graph = graph.insert_after("first", OnLoop("middle", (B,), B))
        graph = graph.insert_after("second", OnLoop("read", (B,), C))
        assert _run(graph).get(C).trail == ("make", "first", "middle", "second", "read")

    def test_amending_a_graph_input(self) -> None:
        """An input type can be amended too."""
        graph = StepGraph([OnLoop("edit", (A,), A), OnLoop("read", (A,), B)], inputs=[A])
        ctx = StepContext(step_id=1, inputs=[A(trail=("input",))])

        async def main() -> None:
            await graph.run(ctx)

        anyio.run(main)
        assert ctx.get(B).trail == ("input", "edit", "read")

    def test_two_providers_are_still_refused(self) -> None:
        """A stage that does not require its type cannot provide it a second time."""
        with pytest.raises(GraphError, match="both provide B"):
            StepGraph([OnLoop("one", (), B), OnLoop("two", (A,), B), OnLoop("a", (), A)])

    def test_an_amender_without_a_provider_is_a_cycle(self) -> None:
        """Nothing to amend: the stage waits on itself."""
        with pytest.raises(GraphError, match="cycle edit → edit"):
            StepGraph([OnLoop("edit", (B,), B)])
