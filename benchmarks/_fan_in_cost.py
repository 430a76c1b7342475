"""Fan-in per step: the engine's ``execute → fan_in`` over real in-process workers whose
graph has the default shape with no-op stages (see ``step_overhead.py``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import attrs
from _noop import NoopStage, median_us

from pipeline.artifacts import (
    LoadStarted,
    MetadataBound,
    ModelOutput,
    SampledTokens,
    SaveResult,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.executors.inprocess import InProcessExecutor
from pipeline.executors.worker import Worker
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.stage import Finalizer
from pipeline.steplog import StepLog
from stages.execute import ExecuteStage
from stages.fan_in import FanInAggregator, FanInStage

__all__ = ["measure_fan_in", "print_fan_in"]


@attrs.frozen
class NoopFinished:
    """The worker graph's last stage: this rank's (empty) ``WorkerOutput`` of the step."""

    name: ClassVar[str] = "finished"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, SampledTokens, SaveResult)
    provides: ClassVar[type] = WorkerOutput

    rank: int

    async def run(self, ctx: StepContext) -> WorkerOutput:
        return WorkerOutput(rank=self.rank, step_id=ctx.step_id)


@attrs.frozen
class NoopClear(Finalizer):
    """A finalizer without a drain, like the connector ``clear``."""

    name: ClassVar[str] = "clear"

    def finalize(self, ctx: StepContext) -> None:
        ctx.scratch["cleared"] = True


def noop_worker(rank: int, step_log: StepLog) -> Worker:
    """A real Worker whose graph has the default shape and no-op stages."""
    so = (SchedulerOutput,)
    graph = StepGraph(
        [
            NoopStage("bind", so, MetadataBound, MetadataBound(False)),
            NoopStage("load", (*so, MetadataBound), LoadStarted, LoadStarted(False)),
            NoopStage(
                "forward", (*so, LoadStarted), ModelOutput, ModelOutput(req_ids=(), logits=None)
            ),
            NoopStage("sample", (*so, ModelOutput), SampledTokens, SampledTokens()),
            NoopStage("save", (ModelOutput,), SaveResult, SaveResult()),
            NoopFinished(rank),
            NoopClear(),
        ],
        inputs=so,
        name="worker",
    )
    return Worker(rank, graph, connector=None, runner=None, step_log=step_log)


def fan_in_graph(workers: list[Worker]) -> StepGraph:
    """``execute → fan_in`` over the in-process executor of ``workers``."""
    return StepGraph(
        [
            ExecuteStage(InProcessExecutor(workers)),
            FanInStage(FanInAggregator(len(workers))),
        ],
        inputs=(SchedulerOutput,),
        name="engine",
    )


async def measure_fan_in(steps: int, ranks: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """Per-step µs of ``execute → fan_in`` with each number of ranks, and one worker alone."""
    step_log = StepLog(None)
    graphs = {n: fan_in_graph([noop_worker(r, step_log) for r in range(n)]) for n in ranks}
    alone = noop_worker(0, step_log)
    outputs = [SchedulerOutput(step_id=i) for i in range(max(steps, 500))]

    def engine_step(graph: StepGraph) -> Callable[[StepContext], Coroutine[Any, Any, Any]]:
        async def run(ctx: StepContext) -> None:
            await graph.run(StepContext(ctx.step_id, None, inputs=(outputs[ctx.step_id],)))

        return run

    async def worker_step(ctx: StepContext) -> None:
        await alone.step(outputs[ctx.step_id])

    samples: dict[str, list[float]] = {"worker": [], **{str(n): [] for n in ranks}}
    for _ in range(3):  # rounds, so that every variant shares any drift
        samples["worker"].append(await median_us(worker_step, steps // 3 or 1))
        for n in ranks:
            samples[str(n)].append(await median_us(engine_step(graphs[n]), steps // 3 or 1))
    us = {k: statistics.median(v) for k, v in samples.items()}
    one, many = us[str(ranks[0])], us[str(ranks[-1])]
    return {
        "graph": f"{graphs[ranks[0]]} (worker: {alone.graph})",
        "worker_alone_us": round(us["worker"], 2),
        **{f"ranks_{n}_us": round(us[str(n)], 2) for n in ranks},
        "fan_in_added_us": round(one - us["worker"], 2),
        "ratio": round(many / one, 2),
        "per_extra_rank_us": round((many - one) / (ranks[-1] - ranks[0]), 2),
    }


def print_fan_in(row: dict[str, Any], backend: str, steps: int) -> None:
    print(f"\nFan-in per step ({backend}, {steps} steps, no-op worker graphs)")
    headers = (
        "1 worker alone",
        "1 rank µs",
        "4 ranks µs",
        "ratio 4/1",
        "per extra rank",
        "fan-in added",
    )
    cells = (f"{row['worker_alone_us']:.1f}", f"{row['ranks_1_us']:.1f}",
             f"{row['ranks_4_us']:.1f}", f"{row['ratio']:.2f}x",
             f"{row['per_extra_rank_us']:.1f}", f"{row['fan_in_added_us']:.1f}")  # fmt: skip
    print("  ".join(f"{h:>15}" for h in headers))
    print("  ".join(f"{c:>15}" for c in cells))
    print(f"  {row['graph']}")
