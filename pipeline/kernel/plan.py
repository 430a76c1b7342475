"""The execution plan of a step graph's body, computed once when the graph is built.

The body's stages form a partial order (a stage follows every stage whose artifact it
requires). The plan is the modular decomposition of that order:

* a **series** (a plain ``tuple``) runs its items one after the other, awaited directly
  by the runner: a linear chain costs no task at all;
* a :class:`Parallel` block runs its branches concurrently in one task group (the first
  branch in the current task, the others as spawned tasks);
* a :class:`Dataflow` block, for the rare part that is not series-parallel (an "N"
  shape), runs one task per stage, each waiting on an event per predecessor;
* a :class:`Fused` block runs adjacent compute stages of one ``runs_on``
  (:mod:`pipeline.kernel.compute`) in one hand-over to their thread (:func:`fuse`).

Each form but :class:`Fused` waits exactly for what the dataflow requires, so the plan
never delays a stage whose inputs are ready; fusing the head of a parallel branch into
the compute stage before it delays that branch's siblings by the head's compute time
(``save`` waits for ``sample``), the price of one hop instead of two. Stage indices
are positions in the graph's ``stages`` tuple.
:class:`StepPlan` bundles the body plan with the bound methods the runner calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs

from pipeline.kernel.compute import Hop, hop_of
from pipeline.kernel.stage import is_immediate, lane
from pipeline.kernel.validate import has_drain

if TYPE_CHECKING:
    from pipeline.kernel.context import StepContext
    from pipeline.kernel.stage import Stage

__all__ = [
    "Dataflow",
    "FinalizerPlan",
    "Fused",
    "Item",
    "Parallel",
    "StepPlan",
    "decompose",
    "describe",
    "fuse",
]


@attrs.frozen
class Parallel:
    """Branches with no order between them; each branch is an item (often a series)."""

    branches: tuple[Item, ...]


@attrs.frozen
class Dataflow:
    """Stages run as tasks; ``waits[k]`` lists the members ``members[k]`` waits for."""

    members: tuple[int, ...]
    waits: tuple[tuple[int, ...], ...]


@attrs.frozen
class Fused:
    """Compute stages run one after the other in one hand-over to their thread.

    Attributes:
        members: Stage indices, in the order they run (at least two).
        hop: The index of the member whose ``hop`` hands the block over, or ``None``
            (no member has one: the block runs on the event loop).
    """

    members: tuple[int, ...]
    hop: int | None


Item: TypeAlias = "int | tuple[Item, ...] | Parallel | Dataflow | Fused"
"""A stage index, a series of items, or a block."""


def _components(nodes: Sequence[int], linked: Callable[[int, int], bool]) -> list[list[int]]:
    """Connected components of ``nodes`` under ``linked``, each in the order of ``nodes``."""
    label = {n: n for n in nodes}

    def root(n: int) -> int:
        while label[n] != n:
            label[n] = label[label[n]]
            n = label[n]
        return n

    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            if linked(a, b):
                label[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for n in nodes:
        groups.setdefault(root(n), []).append(n)
    return sorted(groups.values(), key=lambda g: nodes.index(g[0]))


def decompose(order: Sequence[int], deps: Sequence[Sequence[int]]) -> tuple[Item, ...]:
    """Return the body plan as a top-level series.

    Args:
        order: Every stage index, in a topological order.
        deps: ``deps[i]``: the stages whose artifacts stage ``i`` requires.
    """
    ancestors = [0] * len(deps)
    for i in order:
        for d in deps[i]:
            ancestors[i] |= ancestors[d] | (1 << d)

    def before(a: int, b: int) -> bool:
        return bool((ancestors[b] >> a) & 1)

    def comparable(a: int, b: int) -> bool:
        return before(a, b) or before(b, a)

    def split(nodes: list[int]) -> Item:
        if len(nodes) == 1:
            return nodes[0]
        independent = _components(nodes, comparable)
        if len(independent) > 1:
            return Parallel(tuple(split(group) for group in independent))
        ordered = _components(nodes, lambda a, b: not comparable(a, b))
        if len(ordered) > 1:
            series: list[Item] = []
            for group in ordered:
                part = split(group)
                series.extend(part if isinstance(part, tuple) else (part,))
            return tuple(series)
        waits = []
        for n in nodes:
            preds = [m for m in nodes if before(m, n)]
            direct = [m for m in preds if not any(before(m, k) for k in preds)]
            waits.append(tuple(direct))
        return Dataflow(tuple(nodes), tuple(waits))

    if not order:
        return ()
    top = split(list(order))
    return top if isinstance(top, tuple) else (top,)


def fuse(body: tuple[Item, ...], lanes: Mapping[int, str], hops: Sequence[int]) -> tuple[Item, ...]:
    """``body`` with adjacent compute stages of one lane as :class:`Fused` blocks.

    In a series, a compute stage takes the compute stages of its lane that follow it,
    and, when the next item is a parallel block, the leading run of its lane's stages of
    the first branch that starts with one (that branch goes on with the rest; a block
    left with one branch becomes a series). Pulling a branch's head before the block
    keeps every dependency (the head depended only on what came before the block) and
    only orders the siblings after it.

    Args:
        lanes: Stage index → its ``runs_on``, for the compute stages only.
        hops: The compute stages that have a ``hop``.
    """
    with_hop = set(hops)

    def head(branch: Item, name: str) -> tuple[list[int], list[Item]]:
        parts: list[Item] = list(branch) if isinstance(branch, tuple) else [branch]
        taken: list[int] = []
        while parts and isinstance(first := parts[0], int) and lanes.get(first) == name:
            taken.append(first)
            parts.pop(0)
        return taken, parts

    def series(items: Sequence[Item]) -> tuple[Item, ...]:
        todo, out = list(items), []
        while todo:
            it = todo.pop(0)
            name = lanes.get(it) if isinstance(it, int) else None
            if name is None or not isinstance(it, int):
                out.append(item(it))
                continue
            chain: list[int] = [it]
            while todo:
                nxt = todo[0]
                if isinstance(nxt, int) and lanes.get(nxt) == name:
                    chain.append(nxt)
                    todo.pop(0)
                    continue
                if not isinstance(nxt, Parallel):
                    break
                branches = list(nxt.branches)
                heads = [head(branch, name) for branch in branches]
                k = next((j for j, (taken, _) in enumerate(heads) if taken), -1)
                if k < 0:
                    break
                taken, rest = heads[k]
                chain.extend(taken)
                kept = [b for j, b in enumerate(branches) if j != k]
                if rest:
                    kept.insert(k, rest[0] if len(rest) == 1 else tuple(rest))
                todo.pop(0)
                if len(kept) > 1:
                    todo.insert(0, Parallel(tuple(kept)))
                elif kept:
                    todo[:0] = list(kept[0]) if isinstance(kept[0], tuple) else [kept[0]]
            if len(chain) == 1:
                out.append(it)
            else:
                first_hop = next((m for m in chain if m in with_hop), None)
                out.append(Fused(tuple(chain), first_hop))
        return tuple(out)

    def item(it: Item) -> Item:
        if isinstance(it, tuple):
            return series(it)
        if isinstance(it, Parallel):
            return Parallel(
                tuple(
                    b if len(b := series(br if isinstance(br, tuple) else (br,))) > 1 else b[0]
                    for br in it.branches
                )
            )
        return it

    return series(body)


def describe(item: Item, names: Sequence[str]) -> str:
    """Render an item: ``a → b``, parallel branches as ``{a | b}``.

    A :class:`Dataflow` block is shown level by level (``{a | b} → {c | d}``), which
    is approximate: a stage may start before the whole previous level is done.
    """
    if isinstance(item, int):
        return names[item]
    if isinstance(item, tuple):
        return " → ".join(describe(part, names) for part in item)
    if isinstance(item, Parallel):
        return "{" + " | ".join(describe(b, names) for b in item.branches) + "}"
    if isinstance(item, Fused):
        return " → ".join(names[m] for m in item.members)
    level: dict[int, int] = {}
    for member, waits in zip(item.members, item.waits, strict=True):
        level[member] = 1 + max((level[w] for w in waits), default=-1)
    rows = [
        [names[m] for m in item.members if level[m] == depth]
        for depth in range(max(level.values()) + 1)
    ]
    return " → ".join(row[0] if len(row) == 1 else "{" + " | ".join(row) + "}" for row in rows)


@attrs.frozen
class FinalizerPlan:
    """A finalizer as the runner calls it: ``drain`` is ``None`` when it has nothing to await."""

    name: str
    drain: Callable[[StepContext], Awaitable[None]] | None
    finalize: Callable[[StepContext], None]
    timeout_s: float


@attrs.frozen
class StepPlan:
    """Everything the runner needs, resolved once per graph; immutable and shareable.

    Attributes:
        body: The body plan as a top-level series (see :mod:`pipeline.kernel.plan`).
        run_body: ``body`` as the runner walks it: a parallel block's ``immediate``
            branches run first, in the current task, and a block left with one other
            branch becomes a series (no task group); see :func:`inline_immediate`.
        names: Body stage names, by stage index.
        runs: Bound ``run`` methods, by stage index.
        computes: Bound ``compute`` methods of compute stages, by stage index
            (``None`` for the others).
        hops: Bound ``hop`` methods, by stage index (``None`` where there is none).
        provides: ``provides`` types, by stage index.
        order: Stage indices in the order reports list them (topological).
        inputs: Types the context must hold before the body starts.
        finalizers: The finalizers, in the order they run (reversed declaration).
    """

    body: tuple[Item, ...]
    run_body: tuple[Item, ...]
    names: tuple[str, ...]
    runs: tuple[Callable[[StepContext], Awaitable[Any]], ...]
    computes: tuple[Callable[[StepContext], Any] | None, ...]
    hops: tuple[Hop | None, ...]
    provides: tuple[type | None, ...]
    order: tuple[int, ...]
    inputs: tuple[type, ...]
    finalizers: tuple[FinalizerPlan, ...]

    @classmethod
    def build(
        cls,
        stages: Sequence[Stage],
        finalizers: Sequence[Stage],
        inputs: tuple[type, ...],
        body: tuple[Item, ...],
    ) -> StepPlan:
        """Resolve bound methods and flags of validated stages (called by StepGraph);
        ``body`` is the decomposed plan, fused here (:func:`fuse`)."""
        fins = tuple(
            FinalizerPlan(
                name=f.name,
                drain=f.run if has_drain(f) else None,
                finalize=f.finalize,  # type: ignore[attr-defined]
                timeout_s=float(f.timeout_s),  # type: ignore[attr-defined]
            )
            for f in reversed(finalizers)
        )
        lanes = {i: name for i, s in enumerate(stages) if (name := lane(s)) is not None}
        hops = tuple(hop_of(s) if i in lanes else None for i, s in enumerate(stages))
        body = fuse(body, lanes, [i for i, h in enumerate(hops) if h is not None])
        return cls(
            body=body,
            run_body=inline_immediate(body, {i for i, s in enumerate(stages) if is_immediate(s)}),
            names=tuple(s.name for s in stages),
            runs=tuple(s.run for s in stages),
            computes=tuple(
                s.compute if i in lanes else None  # type: ignore[attr-defined]
                for i, s in enumerate(stages)
            ),
            hops=hops,
            provides=tuple(s.provides for s in stages),
            order=tuple(_flatten(body)),
            inputs=inputs,
            finalizers=fins,
        )


def inline_immediate(body: tuple[Item, ...], immediate: set[int]) -> tuple[Item, ...]:
    """``body`` with each parallel block's immediate branches (a stage that never
    suspends) moved in front of it as a series; a block left with one branch becomes
    that branch. Branches have no order between them, so running a branch that cannot
    wait before the others changes no result, only saves the task group and its tasks.
    """

    def series(items: tuple[Item, ...]) -> tuple[Item, ...]:
        out: list[Item] = []
        for part in items:
            done = item(part)
            if isinstance(part, Parallel) and isinstance(done, tuple):
                out.extend(done)  # spliced into this series: one level less to walk
            else:
                out.append(done)
        return tuple(out)

    def item(it: Item) -> Item:
        if isinstance(it, tuple):
            return series(it)
        if not isinstance(it, Parallel):
            return it
        branches = [item(b) for b in it.branches]
        first = [b for b in branches if isinstance(b, int) and b in immediate]
        rest = [b for b in branches if not (isinstance(b, int) and b in immediate)]
        if not first:
            return Parallel(tuple(branches))
        if len(rest) > 1:
            return (*first, Parallel(tuple(rest)))
        return (*first, *rest)

    return series(body)


def _flatten(item: Item | tuple[Item, ...]) -> list[int]:
    if isinstance(item, int):
        return [item]
    if isinstance(item, Parallel):
        return [i for b in item.branches for i in _flatten(b)]
    if isinstance(item, Dataflow | Fused):
        return list(item.members)
    return [i for part in item for i in _flatten(part)]
