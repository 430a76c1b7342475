"""kvstep's built-in stages and the default step graphs built from them.

engine:  schedule → execute → fan_in → update ⟂ fail_step
worker:  bind → load → forward → logits → structured → sample → save → finished
         ⟂ clear → drop_finished
"""

from __future__ import annotations

from stages.bind import BindStage
from stages.clear import ClearConnectorStage
from stages.drop_finished import DropFinishedStage, DropsRequests
from stages.execute import ExecuteStage, Executor, SubmittedStep
from stages.fail_step import FailStepStage
from stages.fan_in import FanInAggregator, FanInStage
from stages.finished import FinishedStage
from stages.forward import ForwardStage
from stages.graphs import default_engine_graph, default_worker_graph
from stages.load import LoadStage
from stages.logits import LogitsAdjustStage
from stages.sample import SampleStage
from stages.save import SaveStage
from stages.schedule import ScheduleStage
from stages.update import UpdateStage

__all__ = [
    "BindStage",
    "ClearConnectorStage",
    "DropFinishedStage",
    "DropsRequests",
    "ExecuteStage",
    "Executor",
    "FailStepStage",
    "FanInAggregator",
    "FanInStage",
    "FinishedStage",
    "ForwardStage",
    "LoadStage",
    "LogitsAdjustStage",
    "SampleStage",
    "SaveStage",
    "ScheduleStage",
    "SubmittedStep",
    "UpdateStage",
    "default_engine_graph",
    "default_worker_graph",
]
