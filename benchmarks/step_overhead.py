"""How much time does the StepGraph runner add to a step, compared with plain awaits?

Two graphs of 10 no-op stages plus a no-op finalizer (with an explicit, awaited drain):

* ``chain``:    s0 → s1 → … → s9
* ``parallel``: s0 → s1 → {s2 | s3} → s4 → {s5 | s6 | s7} → s8 → s9

each against the same 10 coroutines awaited in sequence by hand, results stored in the
context, inside ``try``/``finally`` with the finalizer's drain and ``finalize``. Reports
the median µs per step, the µs the runner adds and the ratio. Goal: < 50 µs added.

A third column, "hand+TG", writes the same parallel blocks by hand with anyio task groups
(and the finalizer's ``move_on_after(shield=True)``): the price of concurrency itself, so
"added vs TG" is what the runner's own bookkeeping costs.

Fan-in: the engine's ``execute → fan_in`` graph over real :class:`pipeline.executors.worker.Worker`
objects (in-process executor, ``FanInAggregator``) whose worker graph has the default
shape ``bind → load → forward → {sample | save} → finished ⟂ clear`` made of no-op
stages, so no model runs: median µs per step with 1 rank and with 4, and their ratio;
"1 worker alone" is one ``Worker.step`` awaited directly, so "fan-in added" is the cost
of the execute/fan_in stages themselves (``execute`` runs the ranks under the deadline,
``fan_in`` merges their outputs; the two together do what they did when ``fan_in``
awaited the ranks, so the numbers compare across that change).

KV events (``_kv_events_cost.py``): a scheduler step (fake model, evicting pool) with
events off, collected and published, steps/10 steps per variant: "no cost when off".

Decode step (``_decode_step.py``, issue 15): a batch-1 decode step of a random 1-layer
Llama (vocab 1,000, hidden 64), fp32, one torch thread: kvstep's inter-token time against
transformers' bare forward of one token with its KV cache and ``generate()`` per token,
and kvstep's per-stage medians from the step log. Goal: kvstep <= 1.15x the bare forward.
``--decode-tokens 0`` skips it.

    python benchmarks/step_overhead.py [--steps N] [--json PATH] [--backend asyncio|trio]
        [--decode-tokens N] [--decode-rounds N]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, ClassVar

import anyio
import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _decode_step import measure_decode_step, print_decode_step
from _fan_in_cost import measure_fan_in, print_fan_in
from _kv_events_cost import measure_kv_events, print_kv_events
from _noop import NoopStage, median_us
from _results import save

from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.stage import Finalizer

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "step_overhead.json"
ARTIFACTS = tuple(type(f"A{i}", (), {"__slots__": ()}) for i in range(10))


@attrs.frozen
class NoopFinalizer(Finalizer):
    """A finalizer with an explicit (empty) drain, so the shielded scope is measured."""

    name: ClassVar[str] = "clear"

    async def run(self, ctx: StepContext) -> None:
        return None

    def finalize(self, ctx: StepContext) -> None:
        ctx.scratch["cleared"] = True


def make_stages(deps: list[tuple[int, ...]]) -> list[NoopStage]:
    """Stage ``i`` provides ``A{i}`` and requires ``A{j}`` for every ``j`` in ``deps[i]``."""
    return [
        NoopStage(f"s{i}", tuple(ARTIFACTS[j] for j in d), ARTIFACTS[i], ARTIFACTS[i]())
        for i, d in enumerate(deps)
    ]


VARIANTS: dict[str, list[tuple[int, ...]]] = {
    "chain": [(), *((i - 1,) for i in range(1, 10))],
    "parallel": [(), (0,), (1,), (1,), (2, 3), (4,), (4,), (4,), (5, 6, 7), (8,)],
}
# The same dataflow written by hand with anyio task groups: a tuple is a parallel block.
LAYOUTS: dict[str, list[int | tuple[int, ...]]] = {
    "chain": list(range(10)),
    "parallel": [0, 1, (2, 3), 4, (5, 6, 7), 8, 9],
}


async def by_hand(stages: list[NoopStage], fin: NoopFinalizer, ctx: StepContext) -> None:
    """The baseline: the same coroutines awaited in order, cleanup in ``finally``."""
    try:
        for s in stages:
            ctx.put(await s.run(ctx), s.provides)
    finally:
        await fin.run(ctx)
        fin.finalize(ctx)


async def by_hand_with_groups(
    stages: list[NoopStage],
    layout: list[int | tuple[int, ...]],
    fin: NoopFinalizer,
    ctx: StepContext,
) -> None:
    """The concurrency floor: the same parallel blocks as anyio task groups, by hand."""

    async def one(s: NoopStage) -> None:
        ctx.put(await s.run(ctx), s.provides)

    try:
        for item in layout:
            if isinstance(item, int):
                await one(stages[item])
            else:
                async with anyio.create_task_group() as tg:
                    for i in item[1:]:
                        tg.start_soon(one, stages[i])
                    await one(stages[item[0]])
    finally:
        with anyio.move_on_after(5.0, shield=True):
            await fin.run(ctx)
        fin.finalize(ctx)


async def measure(steps: int) -> list[dict[str, Any]]:
    """Run every variant; graph and baseline alternate in rounds to share any drift."""
    rows = []
    fin = NoopFinalizer()
    for variant, deps in VARIANTS.items():
        stages = make_stages(deps)
        graph = StepGraph([*stages, fin], name=variant)

        async def hand(ctx: StepContext, stages: list[NoopStage] = stages) -> None:
            await by_hand(stages, fin, ctx)

        async def floor(
            ctx: StepContext, stages: list[NoopStage] = stages, variant: str = variant
        ) -> None:
            await by_hand_with_groups(stages, LAYOUTS[variant], fin, ctx)

        graph_us, hand_us, floor_us = [], [], []
        for _ in range(3):
            graph_us.append(await median_us(graph.run, steps // 3 or 1))
            hand_us.append(await median_us(hand, steps // 3 or 1))
            floor_us.append(await median_us(floor, steps // 3 or 1))
        g, h, f = (statistics.median(x) for x in (graph_us, hand_us, floor_us))
        rows.append(
            {
                "variant": variant,
                "graph": str(graph),
                "graph_us": round(g, 2),
                "by_hand_us": round(h, 2),
                "added_us": round(g - h, 2),
                "ratio": round(g / h, 2),
                "by_hand_task_groups_us": round(f, 2),
                "added_vs_task_groups_us": round(g - f, 2),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], backend: str, steps: int) -> None:
    title = f"StepGraph overhead per step ({backend}, {steps} steps, 10 stages + 1 finalizer)"
    headers = (
        "variant",
        "graph µs",
        "by hand µs",
        "added µs",
        "ratio",
        "hand+TG µs",
        "added vs TG",
    )
    cells = [
        (r["variant"], f"{r['graph_us']:.1f}", f"{r['by_hand_us']:.1f}", f"{r['added_us']:.1f}",
         f"{r['ratio']:.2f}x", f"{r['by_hand_task_groups_us']:.1f}",
         f"{r['added_vs_task_groups_us']:.1f}")
        for r in rows
    ]  # fmt: skip
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{h:>12}" for h in headers))
        for row in cells:
            print("  ".join(f"{c:>12}" for c in row))
    else:
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for row in cells:
            table.add_row(*row)
        Console().print(table)
    for r in rows:
        print(f"  {r['variant']}: {r['graph']}")
    print(
        "  by hand: the 10 coroutines awaited in sequence; hand+TG: the same parallel blocks\n"
        "  as anyio task groups and the finalizer's shielded scope, written by hand."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000, help="timed steps per variant")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--decode-tokens", type=int, default=300, help="decode: tokens a round")
    parser.add_argument("--decode-rounds", type=int, default=5, help="decode: rounds")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.decode_tokens < 0 or args.decode_rounds < 1:
        parser.error("--decode-tokens must be >= 0 and --decode-rounds >= 1")
    rows = anyio.run(measure, args.steps, backend=args.backend)
    fan_in = anyio.run(measure_fan_in, args.steps, backend=args.backend)
    kv_events = measure_kv_events(max(1, args.steps // 10))
    decode = None
    if args.decode_tokens:
        decode = measure_decode_step(args.decode_tokens, args.decode_rounds, args.backend)
    result = {
        "benchmark": "step_overhead",
        "backend": args.backend,
        "steps": args.steps,
        "python": platform.python_version(),
        "anyio": importlib.metadata.version("anyio"),
        "goal_added_us": 50.0,
        "results": rows,
        "fan_in": fan_in,
        "kv_events": kv_events,
        "decode_step": decode,
    }
    print_table(rows, args.backend, args.steps)
    print_fan_in(fan_in, args.backend, args.steps)
    print_kv_events(kv_events)
    if decode is not None:
        print_decode_step(decode)
    save(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
