"""kvstep's runtime: stages, step graphs, the runner, and the engine front ends.

The engine-level names (``AsyncEngine``, ``LLM``, ``EngineCore``) are imported lazily so
that ``connectors`` and ``stages`` can import the runtime without a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.artifacts import (
    EngineStepOutput,
    FanInOutput,
    KVStats,
    LoadStarted,
    MetadataBound,
    ModelOutput,
    PendingWorkerOutputs,
    SampledTokens,
    SaveResult,
    ScheduledRequest,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.config import EngineConfig, SamplingParams
from pipeline.context import StepContext
from pipeline.errors import (
    ConnectorLifecycleError,
    DuplicateConnectorError,
    EngineDeadError,
    EngineOverloaded,
    FinalizerError,
    GraphError,
    InvalidConfigError,
    InvalidRequestError,
    KvstepError,
    ModelLoadError,
    StageError,
    TransportError,
    UnknownConnectorError,
    WorkerDiedError,
    WorkerFailedError,
)
from pipeline.graph import StepGraph
from pipeline.request import Request, RequestOutput, RequestStatus
from pipeline.runner import StageRecord, StepReport
from pipeline.stage import Finalizer, FunctionStage, Stage, as_stage, is_finalizer, stage
from pipeline.steplog import StepLog, bind_step

if TYPE_CHECKING:
    from pipeline.async_engine import AsyncEngine, RequestStream
    from pipeline.engine import EngineCore
    from pipeline.executor import InProcessExecutor
    from pipeline.llm import LLM
    from pipeline.multiproc import MultiprocExecutor
    from pipeline.ray_executor import RayExecutor

__all__ = [
    "AsyncEngine",
    "ConnectorLifecycleError",
    "DuplicateConnectorError",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineOverloaded",
    "EngineStepOutput",
    "FanInOutput",
    "FinalizerError",
    "Finalizer",
    "FunctionStage",
    "GraphError",
    "InProcessExecutor",
    "InvalidConfigError",
    "InvalidRequestError",
    "KVStats",
    "KvstepError",
    "LLM",
    "LoadStarted",
    "MetadataBound",
    "ModelLoadError",
    "ModelOutput",
    "MultiprocExecutor",
    "PendingWorkerOutputs",
    "RayExecutor",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestStream",
    "SampledTokens",
    "SamplingParams",
    "SaveResult",
    "ScheduledRequest",
    "SchedulerOutput",
    "Stage",
    "StageError",
    "StageRecord",
    "StepContext",
    "StepGraph",
    "StepLog",
    "StepReport",
    "TransportError",
    "UnknownConnectorError",
    "WorkerDiedError",
    "WorkerFailedError",
    "WorkerOutput",
    "as_stage",
    "bind_step",
    "is_finalizer",
    "stage",
]

_LAZY = {
    "AsyncEngine": "pipeline.async_engine",
    "RequestStream": "pipeline.async_engine",
    "EngineCore": "pipeline.engine",
    "InProcessExecutor": "pipeline.executor",
    "MultiprocExecutor": "pipeline.multiproc",
    "RayExecutor": "pipeline.ray_executor",
    "LLM": "pipeline.llm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
