"""StepGraph: an immutable, validated graph of stages wired by artifact type.

Building a graph checks every stage and resolves the edges from ``requires`` /
``provides``; anything wrong raises :class:`~pipeline.errors.GraphError` naming the stage
and the type. The body's execution plan is computed here, once; running a step only walks
it (see :mod:`pipeline.kernel.runner`). Composition methods return new graphs::

    graph = StepGraph([bind, load, forward, sample, save, finished, clear],
                      inputs=[SchedulerOutput], name="worker")
    graph = graph.insert_after("forward", MyStage())
    print(graph)   # bind → load → forward → my_stage → {sample | save} → finished ⟂ clear
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from pipeline.errors import GraphError
from pipeline.kernel import plan as _plan
from pipeline.kernel.context import StepContext
from pipeline.kernel.report import StepReport
from pipeline.kernel.runner import run_step
from pipeline.kernel.stage import Stage, as_stage, is_finalizer
from pipeline.kernel.validate import check_stage, type_name

__all__ = ["StepGraph"]


class StepGraph:
    """An immutable graph of stages plus finalizers; validated when built.

    Thread-safety: a graph is immutable (setting an attribute raises
    ``attrs.exceptions.FrozenInstanceError``) and may be shared by any number of concurrent
    steps, threads and event loops; per-step state lives in the :class:`StepContext`.

    Attributes:
        name: The graph's name, used in error messages.
        stages: The body stages, in declaration order.
        finalizers: The finalizers, in declaration order (they run in reverse).
        inputs: Artifact types the caller puts in the context before running a step.
        names: Every stage name, body and finalizers, in declaration order.
    """

    __slots__ = ("_all", "_plan", "finalizers", "inputs", "name", "names", "stages")

    def __init__(
        self,
        stages: Iterable[Stage | Callable[..., Any]],
        *,
        inputs: Iterable[type] = (),
        name: str = "step",
    ) -> None:
        """Build and validate a graph.

        Args:
            stages: Body stages and finalizers (told apart by :func:`is_finalizer`), in
                any order for the body; finalizers run in reverse of their order here.
                Annotated async functions are wrapped with :func:`~pipeline.kernel.stage.stage`.
            inputs: Artifact types present in the context before the step starts.
            name: The graph's name, for messages.

        Raises:
            GraphError: A stage is malformed; duplicate names; a required type nobody
                provides; two stages (or a stage and an input) providing one type; a
                cycle; a ``run`` return annotation that disagrees with ``provides``; a
                finalizer that requires or provides anything.
        """
        self.name = name
        self._all: tuple[Stage, ...] = tuple(as_stage(s) for s in stages)
        self.inputs: tuple[type, ...] = tuple(inputs)
        for t in self.inputs:
            if not isinstance(t, type):
                raise GraphError(
                    f"graph {name!r}: input {t!r} is not a class; inputs are artifact types",
                    artifact=repr(t),
                )
        seen: set[str] = set()
        for s in self._all:
            check_stage(s)
            if s.name in seen:
                raise GraphError(
                    f"graph {name!r}: two stages are named {s.name!r}; names must be unique",
                    stage=s.name,
                )
            seen.add(s.name)
        self.stages: tuple[Stage, ...] = tuple(s for s in self._all if not is_finalizer(s))
        self.finalizers: tuple[Stage, ...] = tuple(s for s in self._all if is_finalizer(s))
        self.names: tuple[str, ...] = tuple(s.name for s in self._all)
        deps = self._resolve_edges()
        order = self._topological_order(deps)
        self._plan = _plan.StepPlan.build(
            self.stages, self.finalizers, self.inputs, _plan.decompose(order, deps)
        )

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "_plan"):  # set last in __init__: from then on the graph is frozen
            raise attrs.exceptions.FrozenInstanceError()
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise attrs.exceptions.FrozenInstanceError()

    def _resolve_edges(self) -> list[list[int]]:
        """Return, per body stage, the indices of the stages providing what it requires.

        A stage that requires the type it provides **amends** it (a logits stage: it
        reads the logits and returns new ones): the amenders of a type run one after
        the other in declaration order, the first after the type's provider (a stage or
        a graph input), and every other stage that requires the type reads the last
        amender's version.
        """
        provider: dict[type, int] = {}
        amenders: dict[type, list[int]] = {}
        inputs = set(self.inputs)
        for i, s in enumerate(self.stages):
            out = s.provides
            if out is None:
                continue
            if out in s.requires:
                amenders.setdefault(out, []).append(i)
                continue
            if out in inputs:
                raise GraphError(
                    f"graph {self.name!r}: stage {s.name!r} provides {type_name(out)}, which "
                    "is already a graph input; a type has one source",
                    stage=s.name,
                    artifact=type_name(out),
                )
            if out in provider:
                other = self.stages[provider[out]].name
                raise GraphError(
                    f"graph {self.name!r}: stages {other!r} and {s.name!r} both provide "
                    f"{type_name(out)}; a type has one provider (a stage that amends it "
                    "requires it too)",
                    stage=s.name,
                    artifact=type_name(out),
                )
            provider[out] = i
        before: dict[int, int | None] = {}  # amender -> the stage whose version it reads
        for t, chain in amenders.items():
            previous = provider.get(t)
            if previous is None and t not in inputs:
                first = self.stages[chain[0]].name
                raise GraphError(
                    f"graph {self.name!r}: cycle {first} → {first} ({first!r} requires "
                    f"{type_name(t)} from {first!r}); a stage that requires what it "
                    f"provides amends it, and no stage provides {type_name(t)} first, nor "
                    "is it an input",
                    stage=first,
                    artifact=type_name(t),
                )
            for i in chain:
                before[i] = previous
                previous = i
            provider[t] = chain[-1]
        deps: list[list[int]] = []
        for i, s in enumerate(self.stages):
            mine: list[int] = []
            for t in s.requires:
                src = before.get(i) if t is s.provides and i in before else provider.get(t)
                if src is not None:
                    if src not in mine:
                        mine.append(src)
                elif t not in inputs:
                    known = ", ".join(
                        [
                            f"{type_name(p)} (by {self.stages[k].name!r})"
                            for p, k in provider.items()
                        ]
                        + [f"{type_name(p)} (input)" for p in self.inputs]
                    )
                    raise GraphError(
                        f"graph {self.name!r}: stage {s.name!r} requires {type_name(t)}, which "
                        f"no stage provides and is not an input; available: {known or 'none'}",
                        stage=s.name,
                        artifact=type_name(t),
                    )
            deps.append(mine)
        return deps

    def _topological_order(self, deps: list[list[int]]) -> list[int]:
        """Kahn's algorithm, stable in declaration order; a cycle raises naming its stages."""
        waiting = [len(d) for d in deps]
        users: list[list[int]] = [[] for _ in deps]
        for i, d in enumerate(deps):
            for j in d:
                users[j].append(i)
        ready = [i for i, n in enumerate(waiting) if n == 0]
        order: list[int] = []
        while ready:
            i = min(ready)
            ready.remove(i)
            order.append(i)
            for u in users[i]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready.append(u)
        if len(order) < len(deps):
            raise self._cycle_error(deps, set(range(len(deps))) - set(order))
        return order

    def _cycle_error(self, deps: list[list[int]], stuck: set[int]) -> GraphError:
        # Every stuck stage waits on another stuck stage: walk back until one repeats.
        path: list[int] = []
        i = min(stuck)
        while i not in path:
            path.append(i)
            i = next(d for d in deps[i] if d in stuck)
        cycle = path[path.index(i) :][::-1]
        names = [self.stages[k].name for k in cycle]
        edges = "; ".join(
            f"{self.stages[cycle[(n + 1) % len(cycle)]].name!r} requires "
            f"{type_name(self.stages[k].provides)} from {self.stages[k].name!r}"
            for n, k in enumerate(cycle)
        )
        first = self.stages[cycle[0]]
        return GraphError(
            f"graph {self.name!r}: cycle {' → '.join([*names, names[0]])} ({edges})",
            stage=first.name,
            artifact=type_name(first.provides),
        )

    # -- lookup -----------------------------------------------------------------------

    def __getitem__(self, name: str) -> Stage:
        """Return the stage (body or finalizer) called ``name``.

        Raises:
            GraphError: No such stage (the names are listed).
        """
        return self._all[self._index(name)]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[Stage]:
        """Every stage, body and finalizers, in declaration order."""
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise GraphError(
                f"graph {self.name!r} has no stage {name!r}; stages: {', '.join(self.names)}",
                stage=name,
            ) from None

    # -- composition (each returns a new, re-validated graph) -------------------------

    def _with(self, stages: Iterable[Stage | Callable[..., Any]]) -> StepGraph:
        return StepGraph(stages, inputs=self.inputs, name=self.name)

    def _refuse_mandatory(self, name: str, action: str) -> int:
        i = self._index(name)
        if getattr(self._all[i], "mandatory", False):
            raise GraphError(
                f"graph {self.name!r}: cannot {action} finalizer {name!r}; it is mandatory",
                stage=name,
            )
        return i

    def insert_after(self, name: str, stage: Stage | Callable[..., Any]) -> StepGraph:
        """Return a new graph with ``stage`` declared right after the stage ``name``."""
        i = self._index(name)
        return self._with([*self._all[: i + 1], stage, *self._all[i + 1 :]])

    def insert_before(self, name: str, stage: Stage | Callable[..., Any]) -> StepGraph:
        """Return a new graph with ``stage`` declared right before the stage ``name``."""
        i = self._index(name)
        return self._with([*self._all[:i], stage, *self._all[i:]])

    def replace(self, name: str, stage: Stage | Callable[..., Any]) -> StepGraph:
        """Return a new graph with the stage ``name`` replaced by ``stage``.

        Raises:
            GraphError: Unknown name, or ``name`` is a mandatory finalizer.
        """
        i = self._refuse_mandatory(name, "replace")
        return self._with([*self._all[:i], stage, *self._all[i + 1 :]])

    def without(self, name: str) -> StepGraph:
        """Return a new graph without the stage ``name``.

        Raises:
            GraphError: Unknown name, ``name`` is a mandatory finalizer, or another stage
                requires what it provided.
        """
        i = self._refuse_mandatory(name, "remove")
        return self._with([*self._all[:i], *self._all[i + 1 :]])

    def with_finalizer(self, finalizer: Stage) -> StepGraph:
        """Return a new graph with ``finalizer`` appended (so it runs before the others).

        Raises:
            GraphError: ``finalizer`` is not a finalizer, or its name is taken.
        """
        if not is_finalizer(finalizer):
            raise GraphError(
                f"graph {self.name!r}: {finalizer!r} is not a finalizer "
                "(it needs `finalizer = True`, `finalize(ctx)` and `timeout_s`)",
                stage=getattr(finalizer, "name", None),
            )
        return self._with([*self._all, finalizer])

    # -- running ----------------------------------------------------------------------

    async def run(self, ctx: StepContext) -> StepReport:
        """Run one step: the body by dataflow, then every finalizer (see the runner).

        Returns the step's report (also stored in ``ctx.report``, even when this raises).

        Raises:
            BaseException: The body's own error, unmasked, after the finalizers ran (or
                the cancellation, if the body was cancelled).
            FinalizerError: The body succeeded but finalizers failed.
        """
        return await run_step(self._plan, ctx)

    def __str__(self) -> str:
        body = _plan.describe(self._plan.body, self._plan.names) if self.stages else "∅"
        if not self.finalizers:
            return body
        return f"{body} ⟂ {' → '.join(s.name for s in reversed(self.finalizers))}"

    def __repr__(self) -> str:
        return f"StepGraph(name={self.name!r}, {self})"
