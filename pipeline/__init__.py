"""kvstep's runtime: stages, step graphs, the runner, and the engine front ends.

Every public name is imported here, eagerly. ``stages`` and ``connectors`` start with
``import pipeline``, so whichever of the three packages is imported first, this one
initialises first; inside the three packages modules import submodules
(``from connectors.base import X``), never names from a package still initialising.
"""

from __future__ import annotations

from pipeline.artifacts import (
    EngineStepOutput,
    FanInOutput,
    KVStats,
    LoadFailureCause,
    LoadFailures,
    LoadStarted,
    MetadataBound,
    ModelOutput,
    RankOutputs,
    SampledTokens,
    SaveResult,
    ScheduledRequest,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.config import EngineConfig, SamplingParams
from pipeline.engine import LLM, AsyncEngine, EngineCore, RequestStream
from pipeline.errors import (
    ConnectorLifecycleError,
    DuplicateConnectorError,
    EngineDeadError,
    EngineNotStartedError,
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
from pipeline.executors import InProcessExecutor, MultiprocExecutor, RayExecutor
from pipeline.kernel import (
    Finalizer,
    FunctionStage,
    Stage,
    StageRecord,
    StepContext,
    StepGraph,
    StepReport,
    as_stage,
    is_finalizer,
    stage,
)
from pipeline.logprobs import MAX_LOGPROBS, TokenLogprob
from pipeline.request import Request, RequestMetrics, RequestOutput, RequestStatus
from pipeline.steplog import StepLog, bind_step

__all__ = [
    "AsyncEngine",
    "ConnectorLifecycleError",
    "DuplicateConnectorError",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineNotStartedError",
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
    "LoadFailureCause",
    "LoadFailures",
    "LoadStarted",
    "MAX_LOGPROBS",
    "MetadataBound",
    "ModelLoadError",
    "ModelOutput",
    "MultiprocExecutor",
    "RankOutputs",
    "RayExecutor",
    "Request",
    "RequestMetrics",
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
    "TokenLogprob",
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
