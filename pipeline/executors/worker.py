"""One worker rank: how it is built, in the engine's process or a worker's, and how it
runs a step.

The in-process executor and the worker processes build their ranks with the same code
(:func:`build_worker`): the rank's connector half (wrapped in the lifecycle guard, its KV
caches registered), the default worker graph, the configured logits processors
(``EngineConfig.logits_processors``, inserted after ``logits`` in order), and the user's
change to it. A graph function takes the graph, or the graph and a :class:`GraphBuild`
(what the rank is built with), so that a user stage can be built with the runner, the
connector or the config::

    def my_graph(graph: StepGraph, build: GraphBuild) -> StepGraph:
        return graph.insert_after("logits", MyStage(vocab=build.runner.model_config.vocab_size))

A :class:`Worker` then runs the worker graph for its rank, one step at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.lifecycle import make_worker
from connectors.registry import create_connector
from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError, WorkerFailedError
from pipeline.imports import import_path, resolve_import_path
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.steplog import StepLog, bind_step
from stages.finished import UnsentTransfers
from stages.graphs import default_worker_graph
from stages.structured import tokenizer_info

if TYPE_CHECKING:
    from connectors.base import KVConnectorWorker
    from stages.model.runner import ModelRunner

__all__ = [
    "GraphArg",
    "GraphBuild",
    "Worker",
    "apply_graph",
    "build_worker",
    "connector_context",
    "graph_import_path",
]


class Worker:
    """Runs the worker graph for one rank, one step at a time.

    Args:
        rank: This worker's rank.
        graph: The worker graph (``bind → load → forward → {sample | save} → finished ⟂
            clear → drop_finished``): ``bind`` opens the connector's step, the
            finalizers clear it and drop the finished requests of a step that ended
            before its forward pass.
        connector: The rank's worker-side connector (wrapped in the lifecycle guard), or
            ``None``.
        runner: The rank's model runner (owned: closed by :meth:`close`).
        step_log: Where step records go.
    """

    def __init__(
        self,
        rank: int,
        graph: StepGraph,
        *,
        connector: KVConnectorWorker | None,
        runner: Any,
        step_log: StepLog,
    ) -> None:
        self.rank = rank
        self.graph = graph
        self.connector = connector
        self.runner = runner
        self.step_log = step_log
        self.steps = 0
        self.unsent = UnsentTransfers()  # the rank's state across steps: a graph input

    async def step(self, scheduler_output: SchedulerOutput) -> WorkerOutput:
        """Run one step of the worker graph; the ``clear`` finalizer runs whatever happens.

        Cancellation-safe: cancelling it runs the finalizers and re-raises.

        Raises:
            WorkerFailedError: A stage or finalizer failed; carries this rank's report.
        """
        step_id = scheduler_output.step_id
        ctx = StepContext(step_id, self.rank, inputs=(scheduler_output, self.unsent))
        with bind_step(step_id, self.rank):
            try:
                await self.graph.run(ctx)
            except BaseException as exc:
                # The step made its output and then failed (a finalizer: the connector's
                # clear), or was cancelled: the output never leaves this rank, so the
                # transfers it reported go out with the next step (reported twice counts
                # once on the scheduler side; lost, a held send would never be freed).
                lost = ctx.maybe(WorkerOutput)
                if lost is not None:
                    self.unsent.keep(lost.finished_sending, lost.finished_recving)
                if isinstance(exc, Exception):
                    raise WorkerFailedError(
                        self.rank, step_id, repr(exc), report=ctx.report
                    ) from exc
                raise
            finally:
                self.steps += 1
                if ctx.report is not None:
                    self.step_log.record_step(
                        ctx.report,
                        kind="worker",
                        batch_size=len(scheduler_output.requests),
                        num_tokens=scheduler_output.total_num_scheduled_tokens,
                    )
        return ctx.get(WorkerOutput)

    async def aclose(self) -> None:
        """Close the connector and release the runner; idempotent."""
        try:
            if self.connector is not None:
                await self.connector.aclose()
        finally:
            close = getattr(self.runner, "close", None)
            if close is not None:
                close()


@attrs.frozen
class GraphBuild:
    """What one rank's worker graph is built with; the second argument of a graph
    function that takes two.

    Attributes:
        rank: The rank (0 is the driver, which samples).
        world_size: Ranks in the tensor-parallel group.
        runner: The rank's :class:`~stages.model.runner.ModelRunner` (its
            ``model_config``, ``device``, ``compute`` thread, ...).
        connector: The rank's KV connector half (lifecycle-guarded), or ``None``.
        config: The engine's configuration.
    """

    rank: int
    world_size: int
    runner: ModelRunner = attrs.field(repr=False)
    connector: Any = attrs.field(repr=False)
    config: EngineConfig = attrs.field(repr=False)


GraphArg = (
    StepGraph
    | Callable[[StepGraph], StepGraph]
    | Callable[[StepGraph, GraphBuild], StepGraph]
    | str
    | None
)
"""A custom graph: a graph, a function from the default graph (and, if it takes two
arguments, a :class:`GraphBuild`) to a new one, or the import path
(``"module:function"``) of such a function."""


def _takes_build(fn: Callable[..., Any]) -> bool:
    """Whether graph function ``fn`` takes a second positional argument (the build)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(positional) >= 2 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def apply_graph(custom: GraphArg, default: StepGraph, build: GraphBuild | None = None) -> StepGraph:
    """The graph ``custom`` makes of ``default`` (a function taking two arguments also
    gets ``build``).

    Raises:
        InvalidConfigError: An import path that does not import, or a function that does
            not return a :class:`StepGraph`.
    """
    if custom is None:
        return default
    if isinstance(custom, StepGraph):
        return custom
    if isinstance(custom, str):
        custom = resolve_import_path(custom, what="graph")
        if not callable(custom):
            raise InvalidConfigError("graph", custom, "an import path must name a function")
    if build is not None and _takes_build(custom):
        graph = custom(default, build)  # type: ignore[call-arg]
    else:
        graph = custom(default)  # type: ignore[call-arg]
    if not isinstance(graph, StepGraph):
        raise InvalidConfigError(
            "graph", graph, "a graph function must return a StepGraph (e.g. g.insert_after(...))"
        )
    return graph


def graph_import_path(custom: GraphArg) -> str | None:
    """``custom`` as an import path that a worker process can resolve.

    Raises:
        InvalidConfigError: A graph object, a lambda or a nested function: it holds live
            objects or code another process cannot import.
    """
    if custom is None or isinstance(custom, str):
        if isinstance(custom, str):
            resolve_import_path(custom, what="worker_graph")  # fail here, not in N workers
        return custom
    if isinstance(custom, StepGraph):
        raise InvalidConfigError(
            "worker_graph",
            custom,
            "with worker processes, pass a module-level function from the default worker "
            "graph to a new one (or its 'module:function' path), not a built graph",
        )
    return import_path(custom, what="worker_graph")


def connector_context(
    config: EngineConfig,
    *,
    role: KVConnectorRole,
    rank: int,
    fingerprint: ModelFingerprint | None,
) -> ConnectorContext:
    """What a connector half of ``config`` is built with."""
    return ConnectorContext(
        role=role,
        options=dict(config.connector_options),
        block_size=config.block_size,
        fingerprint=fingerprint,
        rank=rank,
        world_size=config.world_size,
        hash_seed=config.hash_seed,
        engine_id=config.engine_id or "",
    )


def with_logits_processors(graph: StepGraph, config: EngineConfig) -> StepGraph:
    """``graph`` with ``config.logits_processors`` inserted after ``logits``, in order.

    Raises:
        InvalidConfigError: An entry that does not resolve to a logits stage.
    """
    if not config.logits_processors:
        return graph
    from pipeline.logits_processors import resolve_logits_processors

    after = "logits"
    for stage in resolve_logits_processors(config):
        graph = graph.insert_after(after, stage)
        after = stage.name
    return graph


def build_worker(
    config: EngineConfig,
    runner: ModelRunner,
    *,
    rank: int,
    worker_graph: GraphArg,
    step_log: StepLog,
) -> Worker:
    """Rank ``rank``'s worker around ``runner`` (which it then owns).

    Raises:
        UnknownConnectorError: ``config.connector`` is not registered.
        InvalidConfigError: A bad custom graph or connector option.
    """
    connector = None
    if config.connector is not None:
        raw = create_connector(
            config.connector,
            KVConnectorRole.WORKER,
            connector_context(
                config, role=KVConnectorRole.WORKER, rank=rank, fingerprint=runner.fingerprint
            ),
        )
        connector = make_worker(raw)
        connector.register_kv_caches(runner.kv_caches)
    graph = default_worker_graph(
        runner,
        rank=rank,
        connector=connector,
        finalizer_timeout_s=config.finalizer_timeout_s,
        tokenizer=tokenizer_info(
            config.model, runner.model_config.vocab_size, runner.model_config.eos_token_id
        ),
        grammar_backend=config.structured_outputs_backend,
    )
    graph = with_logits_processors(graph, config)
    build = GraphBuild(
        rank=rank, world_size=config.world_size, runner=runner, connector=connector, config=config
    )
    graph = apply_graph(worker_graph, graph, build)
    return Worker(rank, graph, connector=connector, runner=runner, step_log=step_log)
