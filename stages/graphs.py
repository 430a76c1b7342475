"""The default step graphs, built from the built-in stages.

engine:  schedule → execute → fan_in → update
worker:  bind → load → forward → {sample | save} → finished ⟂ clear
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connectors.base import KVConnectorWorker
from pipeline.artifacts import SchedulerOutput
from pipeline.kernel.graph import StepGraph
from stages.bind import BindStage
from stages.fan_in import FanInAggregator, FanInStage
from stages.finalize import ClearConnectorStage
from stages.finished import FinishedStage
from stages.forward.stage import ForwardStage, SampleStage
from stages.load import LoadStage
from stages.save import SaveStage
from stages.schedule_stage import ExecuteStage, Executor, ScheduleStage, UpdateStage

if TYPE_CHECKING:
    from stages.forward.runner import ModelRunner
    from stages.schedule.scheduler import Scheduler

__all__ = ["default_engine_graph", "default_worker_graph"]


def default_worker_graph(
    runner: ModelRunner,
    *,
    rank: int = 0,
    connector: KVConnectorWorker | None = None,
    finalizer_timeout_s: float = 30.0,
) -> StepGraph:
    """The worker graph of one rank; rank 0 is the driver that samples."""
    return StepGraph(
        [
            BindStage(connector),
            LoadStage(runner, connector),
            ForwardStage(runner, connector),
            SampleStage(runner, driver=rank == 0),
            SaveStage(connector),
            FinishedStage(rank, connector),
            ClearConnectorStage(
                (connector,) if connector is not None else (), timeout_s=finalizer_timeout_s
            ),
        ],
        inputs=(SchedulerOutput,),
        name="worker",
    )


def default_engine_graph(
    scheduler: Scheduler,
    executor: Executor,
    *,
    aggregator: FanInAggregator,
    fan_in_timeout_s: float = 300.0,
) -> StepGraph:
    """The engine graph: one step of scheduling, execution on all ranks, and update.

    ``aggregator`` carries the transfer lease (``FanInAggregator(lease_s=...)``) and is
    shared with the engine, which forgets aborted requests in it.
    """
    return StepGraph(
        [
            ScheduleStage(scheduler),
            ExecuteStage(executor),
            FanInStage(aggregator, timeout_s=fan_in_timeout_s),
            UpdateStage(scheduler),
        ],
        name="engine",
    )
