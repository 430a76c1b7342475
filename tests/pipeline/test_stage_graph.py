"""Stages, StepContext, StepGraph validation and composition, the plan, and concurrency."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import attrs
import pytest

from pipeline.errors import GraphError, StageError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.plan import Dataflow, Parallel, decompose
from pipeline.kernel.stage import Finalizer, FunctionStage, Stage, as_stage, is_finalizer, stage


class In:
    """The graph input."""


class A:
    pass


class B:
    pass


class C:
    pass


class D:
    pass


@attrs.frozen
class Make:
    """A configurable class stage: records its run, reads its inputs, returns ``provides()``."""

    name: str
    requires: tuple[type, ...] = ()
    provides: type | None = None
    log: list[str] = attrs.field(factory=list, eq=False)

    async def run(self, ctx: StepContext) -> Any:
        for t in self.requires:
            ctx.get(t)
        self.log.append(self.name)
        return self.provides() if self.provides is not None else None


@attrs.frozen
class Clear(Finalizer):
    """A mandatory finalizer with only a synchronous part."""

    name: ClassVar[str] = "clear"
    mandatory: ClassVar[bool] = True

    def finalize(self, ctx: StepContext) -> None:
        ctx.scratch["cleared"] = True


@attrs.frozen
class Extra(Finalizer):
    name: str = "extra"

    def finalize(self, ctx: StepContext) -> None:
        return None


def worker_graph() -> StepGraph:
    return StepGraph(
        [
            Make("bind", (In,), A),
            Make("forward", (A,), B),
            Make("sample", (B,), C),
            Make("save", (B,), D),
            Make("finished", (C, D)),
            Clear(),
        ],
        inputs=[In],
        name="worker",
    )


class TestStageDecorator:
    def test_derives_requires_and_provides_from_annotations(self) -> None:
        """`@stage` reads requires from the parameters after ctx and provides from the return."""

        @stage
        async def combine(ctx: StepContext, a: A, b: B) -> C:
            return C()

        assert isinstance(combine, FunctionStage)
        assert (combine.name, combine.requires, combine.provides) == ("combine", (A, B), C)

    def test_none_return_provides_nothing(self) -> None:
        """A `-> None` function stage has provides=None."""

        @stage
        async def sink(ctx: StepContext, a: A) -> None:
            return None

        assert sink.provides is None

    def test_name_override(self) -> None:
        """`@stage(name=...)` names the stage."""

        @stage(name="renamed")
        async def f(ctx: StepContext) -> A:
            return A()

        assert f.name == "renamed"

    def test_run_passes_required_artifacts(self) -> None:
        """run(ctx) calls the function with ctx.get(T) for each required type."""
        a, b = A(), B()
        seen: list[object] = []

        @stage
        async def combine(ctx: StepContext, x: A, y: B) -> C:
            seen.extend([ctx, x, y])
            return C()

        ctx = StepContext(1, inputs=[a, b])
        out = anyio.run(combine.run, ctx)
        assert isinstance(out, C)
        assert seen == [ctx, a, b]

    def test_decorated_function_stays_callable(self) -> None:
        """Calling a function stage calls the function unchanged."""

        @stage
        async def make_a(ctx: StepContext) -> A:
            return A()

        assert isinstance(anyio.run(make_a, StepContext(0)), A)

    def test_unannotated_parameter_is_refused(self) -> None:
        """An unannotated parameter raises GraphError naming the function and parameter."""

        async def bad(ctx: StepContext, a) -> C:  # type: ignore[no-untyped-def]
            return C()

        with pytest.raises(GraphError, match=r"bad.*'a'") as info:
            stage(bad)
        assert "bad" in str(info.value.stage)

    def test_unannotated_return_is_refused(self) -> None:
        """A function stage without a return annotation raises GraphError naming it."""

        async def no_return(ctx: StepContext, a: A):  # type: ignore[no-untyped-def]
            return None

        with pytest.raises(GraphError, match=r"no_return.*return"):
            stage(no_return)

    def test_non_class_return_is_refused(self) -> None:
        """A return annotation that is not a class (e.g. a union) is refused."""

        async def union(ctx: StepContext) -> A | None:
            return None

        with pytest.raises(GraphError, match="union"):
            stage(union)

    def test_sync_function_is_refused(self) -> None:
        """A plain `def` cannot be a stage."""

        def sync(ctx: StepContext) -> A:
            return A()

        with pytest.raises(GraphError, match=r"sync.*async def"):
            stage(sync)  # type: ignore[arg-type]

    def test_first_parameter_must_be_the_context(self) -> None:
        """The first parameter must be annotated StepContext."""

        async def wrong(a: A) -> B:
            return B()

        with pytest.raises(GraphError, match=r"wrong.*StepContext"):
            stage(wrong)


class TestAsStage:
    def test_identity_for_stage_objects(self) -> None:
        """A stage object is returned unchanged."""
        s = Make("x")
        assert as_stage(s) is s
        assert isinstance(s, Stage)

    def test_wraps_annotated_async_functions(self) -> None:
        """An annotated async function becomes a FunctionStage."""

        async def make_a(ctx: StepContext) -> A:
            return A()

        assert as_stage(make_a).provides is A

    def test_refuses_a_stage_class(self) -> None:
        """Passing the class instead of an instance raises GraphError naming the class."""
        with pytest.raises(GraphError, match="Make is a class"):
            as_stage(Make)

    def test_refuses_other_objects(self) -> None:
        """Anything else raises GraphError."""
        with pytest.raises(GraphError, match="not a stage"):
            as_stage(42)

    def test_is_finalizer(self) -> None:
        """is_finalizer tells finalizers from body stages."""
        assert is_finalizer(Clear())
        assert not is_finalizer(Make("x"))


class TestStepContext:
    def test_inputs_stored_by_exact_type(self) -> None:
        """Inputs are retrievable under their exact type."""
        a = A()
        ctx = StepContext(3, rank=1, inputs=[a])
        assert ctx.get(A) is a
        assert (ctx.step_id, ctx.rank) == (3, 1)

    def test_get_missing_names_the_type(self) -> None:
        """get() of an absent type raises GraphError naming it."""
        with pytest.raises(GraphError, match="no artifact of type B") as info:
            StepContext(0, inputs=[A()]).get(B)
        assert info.value.artifact == "B"

    def test_maybe_and_put(self) -> None:
        """maybe() returns None when absent; put() stores under the given or exact type."""
        ctx = StepContext(0)
        assert ctx.maybe(A) is None
        a = A()
        ctx.put(a)
        assert ctx.maybe(A) is a
        ctx.put(a, object)
        assert ctx.get(object) is a

    def test_put_checks_the_type(self) -> None:
        """put(value, T) with a value that is not a T raises GraphError."""
        with pytest.raises(GraphError, match="as B"):
            StepContext(0).put(A(), B)

    def test_duplicate_inputs_refused(self) -> None:
        """Two inputs of one type raise GraphError."""
        with pytest.raises(GraphError, match="two inputs of type A"):
            StepContext(0, inputs=[A(), A()])


class TestStepGraphValidation:
    def test_missing_provider(self) -> None:
        """A required type nobody provides names the stage and the type."""
        with pytest.raises(GraphError, match=r"stage 'b' requires A.*no stage provides") as info:
            StepGraph([Make("b", (A,), B)])
        assert (info.value.stage, info.value.artifact) == ("b", "A")

    def test_inputs_satisfy_requirements(self) -> None:
        """A required type listed in inputs needs no provider."""
        assert StepGraph([Make("b", (A,), B)], inputs=[A]).inputs == (A,)

    def test_two_providers(self) -> None:
        """Two stages providing one type name both stages and the type."""
        with pytest.raises(GraphError, match="'a1' and 'a2' both provide A") as info:
            StepGraph([Make("a1", (), A), Make("a2", (), A)])
        assert info.value.artifact == "A"

    def test_stage_providing_an_input(self) -> None:
        """A stage providing a graph input type is refused."""
        with pytest.raises(GraphError, match="'a' provides A, which is already a graph input"):
            StepGraph([Make("a", (), A)], inputs=[A])

    def test_cycle_names_its_stages(self) -> None:
        """A cycle names every stage on it and the types."""
        with pytest.raises(GraphError, match="cycle") as info:
            StepGraph([Make("root", (), C), Make("x", (B, C), A), Make("y", (A,), B)])
        message = str(info.value)
        assert "'x'" in message and "'y'" in message and "'root'" not in message
        assert "requires A" in message and "requires B" in message

    def test_self_cycle(self) -> None:
        """A stage requiring its own output is a cycle."""
        with pytest.raises(GraphError, match=r"cycle loop → loop"):
            StepGraph([Make("loop", (A,), A)])

    def test_duplicate_names(self) -> None:
        """Two stages with one name are refused, naming it."""
        with pytest.raises(GraphError, match="two stages are named 'same'"):
            StepGraph([Make("same", (), A), Make("same", (), B)])

    def test_return_annotation_disagrees_with_provides(self) -> None:
        """A class stage whose run is annotated to return another type is refused."""

        @attrs.frozen
        class Liar:
            name: ClassVar[str] = "liar"
            requires: ClassVar[tuple[type, ...]] = ()
            provides: ClassVar[type] = A

            async def run(self, ctx: StepContext) -> B:
                return B()

        with pytest.raises(GraphError, match=r"'liar' declares provides=A.*return B") as info:
            StepGraph([Liar()])
        assert (info.value.stage, info.value.artifact) == ("liar", "A")

    def test_return_annotation_none_vs_provides(self) -> None:
        """provides=None but run annotated to return an artifact is refused."""

        @attrs.frozen
        class Sink:
            name: ClassVar[str] = "sink"
            requires: ClassVar[tuple[type, ...]] = ()
            provides: ClassVar[None] = None

            async def run(self, ctx: StepContext) -> A:
                return A()

        with pytest.raises(GraphError, match="'sink' declares provides=None"):
            StepGraph([Sink()])

    def test_finalizer_must_not_require(self) -> None:
        """A finalizer that requires an artifact is refused, naming it and the type."""

        @attrs.frozen
        class Greedy(Finalizer):
            name: ClassVar[str] = "greedy"
            requires: ClassVar[tuple[type, ...]] = (A,)

            def finalize(self, ctx: StepContext) -> None:
                return None

        with pytest.raises(GraphError, match="finalizer 'greedy' requires A") as info:
            StepGraph([Make("a", (), A), Greedy()])
        assert info.value.artifact == "A"

    def test_finalizer_must_not_provide(self) -> None:
        """A finalizer that provides an artifact is refused."""

        @attrs.frozen
        class Giver(Finalizer):
            name: ClassVar[str] = "giver"
            provides: ClassVar[type] = B

            def finalize(self, ctx: StepContext) -> None:
                return None

        with pytest.raises(GraphError, match="finalizer 'giver' provides B"):
            StepGraph([Giver()])

    def test_finalizer_timeout_must_be_positive(self) -> None:
        """timeout_s <= 0 is refused."""
        with pytest.raises(GraphError, match="timeout_s=0"):
            StepGraph([_Timed(0.0)])

    def test_finalize_must_be_sync(self) -> None:
        """An async finalize is refused."""

        @attrs.frozen
        class AsyncFinalize(Finalizer):
            name: ClassVar[str] = "af"

            async def finalize(self, ctx: StepContext) -> None:  # type: ignore[override]
                return None

        with pytest.raises(GraphError, match=r"'af'.*synchronous"):
            StepGraph([AsyncFinalize()])

    def test_malformed_requires(self) -> None:
        """requires must be a tuple of classes."""
        with pytest.raises(GraphError, match="'m' has requires"):
            StepGraph([Make("m", [A], B)])  # type: ignore[arg-type]

    def test_unknown_input_type(self) -> None:
        """Inputs must be classes."""
        with pytest.raises(GraphError, match="input 'x' is not a class"):
            StepGraph([], inputs=["x"])  # type: ignore[list-item]


@attrs.frozen
class _Timed(Finalizer):
    timeout_s: float
    name: str = "timed"

    def finalize(self, ctx: StepContext) -> None:
        return None


class TestStepGraphComposition:
    def test_attributes(self) -> None:
        """A graph exposes its body, finalizers, inputs and names."""
        g = worker_graph()
        assert [s.name for s in g.stages] == ["bind", "forward", "sample", "save", "finished"]
        assert [f.name for f in g.finalizers] == ["clear"]
        assert g.inputs == (In,)
        assert g.names[-1] == "clear"
        assert g["forward"].provides is B
        assert "save" in g and "nope" not in g

    def test_graph_is_frozen(self) -> None:
        """Attributes of a built graph cannot be reassigned."""
        g = worker_graph()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            g.name = "other"

    def test_unknown_name_lists_the_names(self) -> None:
        """Unknown names in lookups and composition raise GraphError listing the names."""
        g = worker_graph()
        for call in (
            lambda: g["nope"],
            lambda: g.insert_after("nope", Make("x")),
            lambda: g.insert_before("nope", Make("x")),
            lambda: g.replace("nope", Make("x")),
            lambda: g.without("nope"),
        ):
            with pytest.raises(GraphError, match="no stage 'nope'; stages: bind, forward"):
                call()

    def test_insert_after_returns_a_new_graph(self) -> None:
        """insert_after adds a stage after the named one; the original is unchanged."""
        g = worker_graph()
        g2 = g.insert_after("forward", Make("probe", (B,)))
        assert g2.names[:3] == ("bind", "forward", "probe")
        assert "probe" not in g
        assert g2 is not g

    def test_insert_before(self) -> None:
        """insert_before adds a stage before the named one."""
        g = worker_graph().insert_before("bind", Make("pre", (In,)))
        assert g.names[0] == "pre"

    def test_replace(self) -> None:
        """replace swaps a stage; the original graph keeps the old one."""
        g = worker_graph()
        new = Make("sample", (B,), C)
        g2 = g.replace("sample", new)
        assert g2["sample"] is new and g["sample"] is not new

    def test_without(self) -> None:
        """without drops a stage nobody depends on; dropping a provider is re-validated."""
        g = worker_graph().without("finished")
        assert "finished" not in g.names
        with pytest.raises(GraphError, match="'finished' requires D"):
            worker_graph().without("save")

    def test_mandatory_finalizer_cannot_be_removed_or_replaced(self) -> None:
        """without()/replace() of a mandatory finalizer is refused."""
        g = worker_graph()
        with pytest.raises(GraphError, match="cannot remove finalizer 'clear'; it is mandatory"):
            g.without("clear")
        with pytest.raises(GraphError, match="cannot replace finalizer 'clear'"):
            g.replace("clear", Extra(name="clear"))

    def test_optional_finalizer_can_be_removed(self) -> None:
        """A non-mandatory finalizer can be removed."""
        g = worker_graph().with_finalizer(Extra())
        assert g.without("extra").names == worker_graph().names

    def test_with_finalizer_appends(self) -> None:
        """with_finalizer appends; a body stage is refused."""
        g = worker_graph().with_finalizer(Extra())
        assert [f.name for f in g.finalizers] == ["clear", "extra"]
        with pytest.raises(GraphError, match="is not a finalizer"):
            g.with_finalizer(Make("body"))

    def test_function_stages_compose(self) -> None:
        """A plain annotated async function can be inserted."""

        async def probe(ctx: StepContext, b: B) -> None:
            return None

        g = worker_graph().insert_after("forward", probe)
        assert g["probe"].requires == (B,)


class TestStepGraphStr:
    def test_worker_graph(self) -> None:
        """The worker graph reads as a sentence, parallel stages in braces."""
        assert str(worker_graph()) == "bind → forward → {sample | save} → finished ⟂ clear"

    def test_chain_without_finalizers(self) -> None:
        """A chain prints in dataflow order, not declaration order."""
        g = StepGraph([Make("second", (A,), B), Make("first", (), A)])
        assert str(g) == "first → second"

    def test_finalizers_in_run_order(self) -> None:
        """Finalizers are listed after ⟂ in the order they run (reverse declaration)."""
        g = StepGraph([Make("a", (), A), Clear(), Extra()])
        assert str(g) == "a ⟂ extra → clear"

    def test_nested_branches(self) -> None:
        """A branch that is itself a chain is shown inside the braces."""
        g = StepGraph([Make("a", (), A), Make("b", (A,), B), Make("c", (A,), C)])
        g = g.insert_after("b", Make("b2", (B,), D))
        assert str(g) == "a → {b → b2 | c}"


class TestPlan:
    def test_chain_is_a_flat_series(self) -> None:
        """A linear chain plans as plain stage indices: no task groups."""
        assert decompose([0, 1, 2], [[], [0], [1]]) == (0, 1, 2)

    def test_diamond(self) -> None:
        """A diamond plans as series, parallel block, series."""
        assert decompose([0, 1, 2, 3], [[], [0], [0], [1, 2]]) == (0, Parallel((1, 2)), 3)

    def test_independent_chains(self) -> None:
        """Two independent chains are two branches, each a series."""
        assert decompose([0, 1, 2, 3], [[], [0], [], [2]]) == (Parallel(((0, 1), (2, 3))),)

    def test_n_shape_falls_back_to_dataflow(self) -> None:
        """A non-series-parallel order (N shape) becomes a dataflow block with direct waits."""
        plan = decompose([0, 1, 2, 3], [[], [], [0], [0, 1]])
        assert plan == (Dataflow((0, 1, 2, 3), ((), (), (0,), (0, 1))),)


@attrs.frozen
class Rendezvous:
    """Sets its own event, then waits for the other's: only passes if both run at once."""

    name: str
    provides: type
    mine: anyio.Event
    other: anyio.Event
    requires: tuple[type, ...] = ()

    async def run(self, ctx: StepContext) -> Any:
        self.mine.set()
        with anyio.fail_after(2):
            await self.other.wait()
        return self.provides()


@attrs.frozen
class Timed:
    """Sleeps, then records (name, start, end) with anyio's clock."""

    name: str
    requires: tuple[type, ...]
    provides: type | None
    delay: float
    spans: dict[str, tuple[float, float]]

    async def run(self, ctx: StepContext) -> Any:
        start = anyio.current_time()
        await anyio.sleep(self.delay)
        self.spans[self.name] = (start, anyio.current_time())
        return self.provides() if self.provides is not None else None


class TestConcurrency:
    @pytest.mark.asyncio
    async def test_independent_stages_overlap(self) -> None:
        """Two stages with no edge between them run at the same time."""
        e1, e2 = anyio.Event(), anyio.Event()
        g = StepGraph([Rendezvous("left", A, e1, e2), Rendezvous("right", B, e2, e1)])
        ctx = StepContext(0)
        report = await g.run(ctx)
        assert isinstance(ctx.get(A), A) and isinstance(ctx.get(B), B)
        assert report.outcome == "ok"

    @pytest.mark.asyncio
    async def test_dataflow_block_respects_edges_and_overlaps(self) -> None:
        """In an N-shaped graph each stage starts once its own inputs exist, not a level."""
        spans: dict[str, tuple[float, float]] = {}
        g = StepGraph(
            [
                Timed("a", (), A, 0.01, spans),
                Timed("b", (), B, 0.15, spans),
                Timed("c", (A,), C, 0.01, spans),
                Timed("d", (A, B), D, 0.01, spans),
            ]
        )
        await g.run(StepContext(0))
        assert spans["c"][0] >= spans["a"][1]
        assert spans["d"][0] >= max(spans["a"][1], spans["b"][1])
        assert spans["c"][1] < spans["b"][1]  # c did not wait for the slow b

    def test_results_stored_under_provides(self) -> None:
        """Each stage's return value is stored in the context under its provides type."""
        g = worker_graph()
        ctx = StepContext(0, inputs=[In()])
        anyio.run(g.run, ctx)
        for t in (A, B, C, D):
            assert isinstance(ctx.get(t), t)
        assert ctx.scratch["cleared"] is True

    def test_wrong_return_type_fails_the_stage(self) -> None:
        """A stage returning something other than its provides type raises StageError."""

        @attrs.frozen
        class Wrong:
            name: ClassVar[str] = "wrong"
            requires: ClassVar[tuple[type, ...]] = ()
            provides: ClassVar[type] = A

            async def run(self, ctx: StepContext) -> Any:
                return B()

        ctx = StepContext(0)
        with pytest.raises(StageError, match=r"'wrong' failed: returned B.*provides=A"):
            anyio.run(StepGraph([Wrong(), Clear()]).run, ctx)
        assert ctx.scratch["cleared"] is True
        assert ctx.report is not None and ctx.report.failed_stage == "wrong"

    def test_missing_input_fails_the_step_after_finalizers(self) -> None:
        """A context without a graph input fails with GraphError; finalizers still run."""
        ctx = StepContext(0)
        with pytest.raises(GraphError, match="needs input In"):
            anyio.run(worker_graph().run, ctx)
        assert ctx.scratch["cleared"] is True

    def test_runs_under_trio(self) -> None:
        """The runner works under trio through anyio, parallel blocks included."""
        ctx = StepContext(0, inputs=[In()])
        report = anyio.run(worker_graph().run, ctx, backend="trio")
        assert report.outcome == "ok"
        assert ctx.scratch["cleared"] is True
