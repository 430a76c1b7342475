"""The default step graphs, built from the built-in stages.

engine:  schedule → execute → fan_in → update ⟂ fail_step
worker:  bind → load → forward → logits → structured → sample → save → finished
         ⟂ clear → drop_finished
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connectors.base import KVConnectorWorker
from pipeline.artifacts import SchedulerOutput
from pipeline.grammar.backend import TokenizerInfo
from pipeline.kernel.graph import StepGraph
from stages.bind import BindStage
from stages.clear import ClearConnectorStage
from stages.drop_finished import DropFinishedStage
from stages.execute import ExecuteStage, Executor
from stages.fail_step import FailStepStage
from stages.fan_in import FanInAggregator, FanInStage
from stages.finished import FinishedStage, UnsentTransfers
from stages.forward import ForwardStage
from stages.load import LoadStage
from stages.logits import LogitsAdjustStage
from stages.propose import ProposeStage
from stages.sample import SampleStage
from stages.save import SaveStage
from stages.schedule import ScheduleStage, StepLink
from stages.speculative import Proposer
from stages.speculative.budget import DraftBudget
from stages.speculative.proposer import BatchProposer
from stages.structured import GrammarRows, StructuredOutputStage
from stages.update import UpdateStage

if TYPE_CHECKING:
    from stages.model.runner import ModelRunner
    from stages.scheduler.scheduler import Scheduler

__all__ = ["default_engine_graph", "default_worker_graph"]


def default_worker_graph(
    runner: ModelRunner,
    *,
    rank: int = 0,
    connector: KVConnectorWorker | None = None,
    finalizer_timeout_s: float = 30.0,
    tokenizer: TokenizerInfo | None = None,
    grammar_backend: str = "llguidance",
) -> StepGraph:
    """The worker graph of one rank; rank 0 is the driver that samples.

    ``structured`` masks the rows of requests with ``structured_outputs`` to their
    grammar (``tokenizer`` is what the grammars are compiled for, with
    ``grammar_backend``); user logits stages
    inserted after ``logits`` come before it, so the mask has the last word.

    Finalizers: ``clear`` (mandatory: the connector's step metadata), then
    ``drop_finished`` (the runner forgets the requests the scheduler finished when the
    step ended before its forward pass did).
    """
    return StepGraph(
        [
            BindStage(connector),
            LoadStage(runner, connector),
            ForwardStage(runner, connector),
            LogitsAdjustStage(runner, driver=rank == 0),
            StructuredOutputStage(GrammarRows(tokenizer, grammar_backend)),
            SampleStage(runner, driver=rank == 0),
            SaveStage(connector),
            FinishedStage(rank, connector),
            DropFinishedStage(runner),
            ClearConnectorStage(
                (connector,) if connector is not None else (), timeout_s=finalizer_timeout_s
            ),
        ],
        inputs=(SchedulerOutput, UnsentTransfers),
        name="worker",
    )


def _propose(scheduler: Scheduler, proposer: Proposer | BatchProposer) -> ProposeStage:
    return ProposeStage(scheduler, proposer, DraftBudget(proposer.k))


def default_engine_graph(
    scheduler: Scheduler,
    executor: Executor,
    *,
    aggregator: FanInAggregator,
    fan_in_timeout_s: float = 300.0,
    ahead: bool = False,
    proposer: Proposer | BatchProposer | None = None,
) -> StepGraph:
    """The engine graph: schedule, run the ranks, merge, update; a failed step fails
    its requests in the ``fail_step`` finalizer.

    ``aggregator`` carries the transfer lease (``FanInAggregator(lease_s=...)``) and is
    shared with the engine, which forgets aborted requests in it. ``fan_in_timeout_s``
    is the deadline under which ``execute`` awaits every rank's output. ``ahead``
    (async scheduling): every step's :class:`~stages.schedule.StepLink` is an
    input of the graph, which ``schedule`` takes to plan ahead of the step before.
    ``proposer`` (speculative decoding): a ``propose`` stage after ``update`` gives the
    running requests their drafts for the next step (:class:`~stages.propose.ProposeStage`),
    within a per-request :class:`~stages.speculative.budget.DraftBudget`.
    """
    return StepGraph(
        [
            ScheduleStage(scheduler, ahead=ahead),
            ExecuteStage(executor, timeout_s=fan_in_timeout_s),
            FanInStage(aggregator),
            UpdateStage(scheduler),
            *([] if proposer is None else [_propose(scheduler, proposer)]),
            FailStepStage(scheduler, aggregator, executor),
        ],
        inputs=(StepLink,) if ahead else (),
        name="engine",
    )
