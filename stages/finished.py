"""``finished``: collect this rank's result of the step into one ``WorkerOutput``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker, WorkerFinished
from pipeline.artifacts import (
    KVStats,
    LoadFailures,
    LoadStarted,
    SampledTokens,
    SaveFailureCause,
    SaveResult,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.errors import ConnectorLifecycleError
from pipeline.kernel.context import StepContext
from stages.save import failed_step_saves

__all__ = ["FinishedStage", "UnsentTransfers"]


@attrs.define(eq=False)
class UnsentTransfers:
    """Transfers a rank's ``get_finished`` handed over that no ``WorkerOutput`` has
    carried yet: the one piece of the worker step that outlives a step.

    An input of the worker graph: one per rank, kept across that rank's steps by its
    :class:`~pipeline.executors.worker.Worker`, which puts it in every step's context,
    so the stages stay free of state and a graph may be shared. Not thread-safe: one
    rank's steps use it, one after the other.

    Attributes:
        sending: Requests whose KV the connector reported sent.
        recving: Requests whose KV the connector reported received.
    """

    sending: set[str] = attrs.Factory(set)
    recving: set[str] = attrs.Factory(set)

    def keep(self, sending: Iterable[str], recving: Iterable[str]) -> None:
        """Add what ``get_finished`` just handed over."""
        self.sending.update(sending)
        self.recving.update(recving)

    def take(self) -> tuple[frozenset[str], frozenset[str]]:
        """Everything kept, as ``(sending, recving)``; empties it."""
        taken = frozenset(self.sending), frozenset(self.recving)
        self.sending.clear()
        self.recving.clear()
        return taken


@attrs.frozen
class FinishedStage:
    """Asks the connector which transfers finished and which blocks failed to load (and
    why: ``get_load_failures``, asked only when some block failed).

    ``get_finished`` hands its reports over once; when a query after it (the stats, the
    load errors) fails the step, the reports are kept in the rank's
    :class:`UnsentTransfers` (a graph input) and go out with the next step of that
    rank that reaches this stage, so a finished transfer is never lost (the scheduler
    side takes a report twice as once). The stage itself holds no state.

    A ``get_finished`` that raises is a save-side failure: the step goes on, its
    requests keep their tokens, and on this rank every request of the step counts as a
    failed save (``WorkerOutput.save_failures``, cause ``get_finished`` or ``timeout``)
    and nothing is reported finished. The receiving half loses nothing by this: the
    connector reports the completions it did not return in a later call (the contract
    it already keeps under cancellation), so a request parked for an async load stays
    parked exactly as when a step fails (a failed step never failed parked requests),
    and the transfer lease bounds a rank that never reports. After a ``wait_for_save``
    that raised, ``get_finished`` is not called at all this step (a connector may count
    on it following a completed ``wait_for_save``); the same holds for its reports. Load
    errors (``get_block_ids_with_load_errors``) are asked for anyway and keep the load
    policy.
    """

    name: ClassVar[str] = "finished"
    requires: ClassVar[tuple[type, ...]] = (
        SchedulerOutput,
        SampledTokens,
        SaveResult,
        UnsentTransfers,
    )
    provides: ClassVar[type] = WorkerOutput

    rank: int = 0
    connector: KVConnectorWorker | None = None

    async def run(self, ctx: StepContext) -> WorkerOutput:
        scheduler_output = ctx.get(SchedulerOutput)
        samples = ctx.get(SampledTokens)
        sampled = samples.token_ids
        failed_saves = ctx.get(SaveResult).failed_req_ids
        loads = ctx.maybe(LoadStarted)
        if self.connector is None or loads is None or not loads.started:
            return WorkerOutput(
                rank=self.rank,
                step_id=scheduler_output.step_id,
                sampled_token_ids=sampled,
                failed_save_req_ids=failed_saves,
                request_errors=samples.errors,
                logprobs=samples.logprobs,
                prompt_logprobs=samples.prompt_logprobs,
            )
        saved = ctx.get(SaveResult)
        save_failures = saved.failures
        try:
            finished = (
                WorkerFinished()  # get_finished follows a wait_for_save that returned
                if saved.wait_raised
                else await self.connector.get_finished(scheduler_output.finished_req_ids)
            )
        except ConnectorLifecycleError:
            raise
        except Exception as exc:  # save side (see the class docstring): costs caching only
            finished = WorkerFinished()
            save_failures = save_failures.add(SaveFailureCause.GET_FINISHED, exc)
            failed_saves |= failed_step_saves(scheduler_output)
        unsent = ctx.get(UnsentTransfers)
        unsent.keep(finished.sending, finished.recving)
        # KVStats._make: a connector written before the stats had names returns a 4-tuple.
        stats = KVStats._make(self.connector.get_kv_stats())
        invalid = frozenset(self.connector.get_block_ids_with_load_errors())
        failures = self.connector.get_load_failures() if invalid else None
        sending, recving = unsent.take()
        return WorkerOutput(
            rank=self.rank,
            step_id=scheduler_output.step_id,
            sampled_token_ids=sampled,
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=invalid,
            failed_save_req_ids=failed_saves,
            request_errors=samples.errors,
            logprobs=samples.logprobs,
            prompt_logprobs=samples.prompt_logprobs,
            stats=stats,
            load_failures=failures or LoadFailures(),
            save_failures=save_failures,
        )
