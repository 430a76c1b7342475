"""The graph kernel: stages, step graphs, their plan, the runner and its report.

It imports nothing of kvstep but :mod:`pipeline.errors`: the engine, the executors, the
stages and the connectors are built on it, never the other way round.
"""

from __future__ import annotations

from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StageOutcome, StageRecord, StepOutcome, StepReport
from pipeline.kernel.runner import run_step
from pipeline.kernel.stage import (
    Finalizer,
    FunctionStage,
    Stage,
    as_stage,
    is_collective,
    is_finalizer,
    is_immediate,
    stage,
)

__all__ = [
    "Finalizer",
    "FunctionStage",
    "Stage",
    "StageOutcome",
    "StageRecord",
    "StepContext",
    "StepGraph",
    "StepOutcome",
    "StepReport",
    "as_stage",
    "is_collective",
    "is_finalizer",
    "is_immediate",
    "run_step",
    "stage",
]
