"""kvstep's runtime: stages, step graphs, the runner, and the engine front ends.

Importing this package imports nothing else: each public name is imported from its
module on first use (PEP 562's module ``__getattr__``), then kept as a plain attribute.
So ``import pipeline.kernel`` or ``import connectors.base`` loads neither torch nor the
engine, and ``from pipeline import LLM`` loads the engine when it runs, not before.
``__all__`` and ``dir(pipeline)`` list every public name from the start.

To export a name, add one line to ``_EXPORTS`` (name → the module that defines it), and
for type checkers and IDEs its import to the ``TYPE_CHECKING`` block, written
``from module import Name as Name``; e.g. for ``pipeline.logits.LogitsStage``:
``"LogitsStage": "pipeline.logits",`` and
``from pipeline.logits import LogitsStage as LogitsStage``. ``__all__`` and ``dir()``
follow ``_EXPORTS``; ``tests/test_lazy_imports.py`` fails, naming the name, when the two lists
disagree or a name does not resolve.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.artifacts import EngineStepOutput as EngineStepOutput
    from pipeline.artifacts import FanInOutput as FanInOutput
    from pipeline.artifacts import KVStats as KVStats
    from pipeline.artifacts import LoadFailureCause as LoadFailureCause
    from pipeline.artifacts import LoadFailures as LoadFailures
    from pipeline.artifacts import LoadStarted as LoadStarted
    from pipeline.artifacts import MetadataBound as MetadataBound
    from pipeline.artifacts import ModelOutput as ModelOutput
    from pipeline.artifacts import RankOutputs as RankOutputs
    from pipeline.artifacts import SampledTokens as SampledTokens
    from pipeline.artifacts import SaveFailureCause as SaveFailureCause
    from pipeline.artifacts import SaveFailures as SaveFailures
    from pipeline.artifacts import SaveResult as SaveResult
    from pipeline.artifacts import ScheduledRequest as ScheduledRequest
    from pipeline.artifacts import SchedulerOutput as SchedulerOutput
    from pipeline.artifacts import WorkerOutput as WorkerOutput
    from pipeline.config import EngineConfig as EngineConfig
    from pipeline.config import SamplingParams as SamplingParams
    from pipeline.engine import LLM as LLM
    from pipeline.engine import AsyncEngine as AsyncEngine
    from pipeline.engine import EngineCore as EngineCore
    from pipeline.engine import RequestStream as RequestStream
    from pipeline.errors import ConnectorLifecycleError as ConnectorLifecycleError
    from pipeline.errors import DuplicateConnectorError as DuplicateConnectorError
    from pipeline.errors import EngineDeadError as EngineDeadError
    from pipeline.errors import EngineNotStartedError as EngineNotStartedError
    from pipeline.errors import EngineOverloaded as EngineOverloaded
    from pipeline.errors import FinalizerError as FinalizerError
    from pipeline.errors import GraphError as GraphError
    from pipeline.errors import InvalidConfigError as InvalidConfigError
    from pipeline.errors import InvalidRequestError as InvalidRequestError
    from pipeline.errors import KvstepError as KvstepError
    from pipeline.errors import ModelLoadError as ModelLoadError
    from pipeline.errors import StageError as StageError
    from pipeline.errors import TransportError as TransportError
    from pipeline.errors import UnknownConnectorError as UnknownConnectorError
    from pipeline.errors import WorkerDiedError as WorkerDiedError
    from pipeline.errors import WorkerFailedError as WorkerFailedError
    from pipeline.executors import InProcessExecutor as InProcessExecutor
    from pipeline.executors import MultiprocExecutor as MultiprocExecutor
    from pipeline.executors import RayExecutor as RayExecutor
    from pipeline.executors.worker import GraphBuild as GraphBuild
    from pipeline.kernel import Finalizer as Finalizer
    from pipeline.kernel import FunctionStage as FunctionStage
    from pipeline.kernel import Stage as Stage
    from pipeline.kernel import StageRecord as StageRecord
    from pipeline.kernel import StepContext as StepContext
    from pipeline.kernel import StepGraph as StepGraph
    from pipeline.kernel import StepReport as StepReport
    from pipeline.kernel import as_stage as as_stage
    from pipeline.kernel import is_finalizer as is_finalizer
    from pipeline.kernel import stage as stage
    from pipeline.logits import Logits as Logits
    from pipeline.logits import LogitsBatch as LogitsBatch
    from pipeline.logits import LogitsStage as LogitsStage
    from pipeline.logprobs import MAX_LOGPROBS as MAX_LOGPROBS
    from pipeline.logprobs import TokenLogprob as TokenLogprob
    from pipeline.lora import LoRAAdapter as LoRAAdapter
    from pipeline.lora import LoRARequest as LoRARequest
    from pipeline.request import Request as Request
    from pipeline.request import RequestMetrics as RequestMetrics
    from pipeline.request import RequestOutput as RequestOutput
    from pipeline.request import RequestStatus as RequestStatus
    from pipeline.steplog import StepLog as StepLog
    from pipeline.steplog import bind_step as bind_step

# Each public name → the module it is imported from on first use.
_EXPORTS: dict[str, str] = {
    "EngineStepOutput": "pipeline.artifacts",
    "FanInOutput": "pipeline.artifacts",
    "KVStats": "pipeline.artifacts",
    "LoadFailureCause": "pipeline.artifacts",
    "LoadFailures": "pipeline.artifacts",
    "LoadStarted": "pipeline.artifacts",
    "MetadataBound": "pipeline.artifacts",
    "ModelOutput": "pipeline.artifacts",
    "RankOutputs": "pipeline.artifacts",
    "SampledTokens": "pipeline.artifacts",
    "SaveFailureCause": "pipeline.artifacts",
    "SaveFailures": "pipeline.artifacts",
    "SaveResult": "pipeline.artifacts",
    "ScheduledRequest": "pipeline.artifacts",
    "SchedulerOutput": "pipeline.artifacts",
    "WorkerOutput": "pipeline.artifacts",
    "GraphBuild": "pipeline.executors.worker",
    "Logits": "pipeline.logits",
    "LogitsBatch": "pipeline.logits",
    "LogitsStage": "pipeline.logits",
    "EngineConfig": "pipeline.config",
    "LoRAAdapter": "pipeline.lora",
    "LoRARequest": "pipeline.lora",
    "SamplingParams": "pipeline.config",
    "LLM": "pipeline.engine",
    "AsyncEngine": "pipeline.engine",
    "EngineCore": "pipeline.engine",
    "RequestStream": "pipeline.engine",
    "ConnectorLifecycleError": "pipeline.errors",
    "DuplicateConnectorError": "pipeline.errors",
    "EngineDeadError": "pipeline.errors",
    "EngineNotStartedError": "pipeline.errors",
    "EngineOverloaded": "pipeline.errors",
    "FinalizerError": "pipeline.errors",
    "GraphError": "pipeline.errors",
    "InvalidConfigError": "pipeline.errors",
    "InvalidRequestError": "pipeline.errors",
    "KvstepError": "pipeline.errors",
    "ModelLoadError": "pipeline.errors",
    "StageError": "pipeline.errors",
    "TransportError": "pipeline.errors",
    "UnknownConnectorError": "pipeline.errors",
    "WorkerDiedError": "pipeline.errors",
    "WorkerFailedError": "pipeline.errors",
    "InProcessExecutor": "pipeline.executors",
    "MultiprocExecutor": "pipeline.executors",
    "RayExecutor": "pipeline.executors",
    "Finalizer": "pipeline.kernel",
    "FunctionStage": "pipeline.kernel",
    "Stage": "pipeline.kernel",
    "StageRecord": "pipeline.kernel",
    "StepContext": "pipeline.kernel",
    "StepGraph": "pipeline.kernel",
    "StepReport": "pipeline.kernel",
    "as_stage": "pipeline.kernel",
    "is_finalizer": "pipeline.kernel",
    "stage": "pipeline.kernel",
    "MAX_LOGPROBS": "pipeline.logprobs",
    "TokenLogprob": "pipeline.logprobs",
    "Request": "pipeline.request",
    "RequestMetrics": "pipeline.request",
    "RequestOutput": "pipeline.request",
    "RequestStatus": "pipeline.request",
    "StepLog": "pipeline.steplog",
    "bind_step": "pipeline.steplog",
}

__all__ = sorted(_EXPORTS)


if not TYPE_CHECKING:  # hidden from type checkers, which read the imports above instead

    def __getattr__(name: str) -> object:
        """Import the public name ``name`` from its module on first use (PEP 562).

        Called only for a name not yet among the package's attributes; the value is kept
        as one, so later uses are plain attribute reads. Blocks while the module imports
        (the engine's names import torch, seconds on a cold start).

        Raises:
            AttributeError: ``name`` is not a public name of the package (nor a submodule
                imported so far), as for any module.
        """
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        """The package's attributes so far and every public name, imported or not."""
        return sorted({*globals(), *_EXPORTS})
