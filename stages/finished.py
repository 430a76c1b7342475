"""``finished``: collect this rank's result of the step into one ``WorkerOutput``."""

from __future__ import annotations

from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import (
    KVStats,
    LoadStarted,
    SampledTokens,
    SaveResult,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.kernel.context import StepContext

__all__ = ["FinishedStage"]


@attrs.frozen
class FinishedStage:
    """Asks the connector which transfers finished and which blocks failed to load."""

    name: ClassVar[str] = "finished"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, SampledTokens, SaveResult)
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
        finished = await self.connector.get_finished(scheduler_output.finished_req_ids)
        loaded_tokens, loaded_bytes, saved_tokens, saved_bytes = self.connector.get_kv_stats()
        return WorkerOutput(
            rank=self.rank,
            step_id=scheduler_output.step_id,
            sampled_token_ids=sampled,
            finished_sending=frozenset(finished.sending),
            finished_recving=frozenset(finished.recving),
            invalid_block_ids=frozenset(self.connector.get_block_ids_with_load_errors()),
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
        )
