"""Building one rank's :class:`~pipeline.executors.worker.Worker`, in the engine's process
or a worker's.

The in-process executor and the worker processes build their ranks with the same code:
the rank's connector half (wrapped in the lifecycle guard, its KV caches registered),
the default worker graph, and the user's change to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.lifecycle import make_worker
from connectors.registry import create_connector
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError
from pipeline.executors.worker import Worker
from pipeline.imports import import_path, resolve_import_path
from pipeline.kernel.graph import StepGraph
from pipeline.steplog import StepLog
from stages.graphs import default_worker_graph

if TYPE_CHECKING:
    from stages.forward.runner import ModelRunner

__all__ = [
    "GraphArg",
    "apply_graph",
    "build_worker",
    "connector_context",
    "graph_import_path",
]

GraphArg = StepGraph | Callable[[StepGraph], StepGraph] | str | None
"""A custom graph: a graph, a function from the default graph to a new one, or the
import path (``"module:function"``) of such a function."""


def apply_graph(custom: GraphArg, default: StepGraph) -> StepGraph:
    """The graph ``custom`` makes of ``default``.

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
    graph = custom(default)
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
    graph = apply_graph(
        worker_graph,
        default_worker_graph(
            runner,
            rank=rank,
            connector=connector,
            finalizer_timeout_s=config.finalizer_timeout_s,
        ),
    )
    return Worker(rank, graph, connector=connector, runner=runner, step_log=step_log)
