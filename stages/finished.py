"""``finished``: collect this rank's result of the step into one ``WorkerOutput``."""

from __future__ import annotations

from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import (
    KVStats,
    LoadFailures,
    LoadStarted,
    SampledTokens,
    SaveResult,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.kernel.context import StepContext

__all__ = ["FinishedStage"]


@attrs.define
class _Reports:
    """Transfers ``get_finished`` handed over that no step's output has carried yet."""

    sending: set[str] = attrs.Factory(set)
    recving: set[str] = attrs.Factory(set)

    def take(self) -> tuple[frozenset[str], frozenset[str]]:
        taken = frozenset(self.sending), frozenset(self.recving)
        self.sending.clear()
        self.recving.clear()
        return taken


@attrs.frozen
class FinishedStage:
    """Asks the connector which transfers finished and which blocks failed to load (and
    why: ``get_load_failures``, asked only when some block failed).

    ``get_finished`` hands its reports over once; when a query after it (the stats, the
    load errors) fails the step, the reports are kept and go out with the next step
    that reaches this stage, so a finished transfer is never lost (the scheduler side
    takes a report twice as once).
    """

    name: ClassVar[str] = "finished"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, SampledTokens, SaveResult)
    provides: ClassVar[type] = WorkerOutput

    rank: int = 0
    connector: KVConnectorWorker | None = None
    _pending: _Reports = attrs.field(factory=_Reports, init=False, repr=False, eq=False)

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
        finished = await self.connector.get_finished(scheduler_output.finished_req_ids)
        pending = self._pending
        pending.sending.update(finished.sending)
        pending.recving.update(finished.recving)
        loaded_tokens, loaded_bytes, saved_tokens, saved_bytes = self.connector.get_kv_stats()
        invalid = frozenset(self.connector.get_block_ids_with_load_errors())
        failures = self.connector.get_load_failures() if invalid else None
        sending, recving = pending.take()
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
            stats=KVStats(
                loaded_tokens=loaded_tokens,
                loaded_bytes=loaded_bytes,
                saved_tokens=saved_tokens,
                saved_bytes=saved_bytes,
            ),
            load_failures=failures or LoadFailures(),
        )
