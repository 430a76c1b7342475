"""``save``: wait until this step's KV saves are durable (or have failed, reported)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import (
    LoadStarted,
    ModelOutput,
    SaveFailureCause,
    SaveFailures,
    SaveResult,
    SchedulerOutput,
)
from pipeline.errors import ConnectorLifecycleError
from pipeline.kernel.context import StepContext

__all__ = ["SaveStage", "failed_step_saves"]


def failed_step_saves(scheduler_output: SchedulerOutput) -> frozenset[str]:
    """The requests whose saves fail when a save-side call raised on a rank: every
    request of the step (the engine cannot tell which blocks the call was saving)."""
    return frozenset(r.req_id for r in scheduler_output.requests)


@attrs.frozen
class SaveStage:
    """Calls ``wait_for_save`` after the forward pass has issued its per-layer saves.

    Failed saves are data, not exceptions: their request ids travel to the scheduler in
    the ``WorkerOutput`` so their blocks are released and the engine keeps serving. A
    save-side call that raises (the forward's ``save_kv_layer``, carried in
    ``ModelOutput.save_error``, or ``wait_for_save`` itself) does not fail the step
    either: it is counted in ``SaveResult.failures`` and every request of the step
    counts as a failed save on this rank (its tokens stand; its blocks are neither
    reported stored nor announced). Cancellation and a ``ConnectorLifecycleError``
    still fail the step.
    """

    name: ClassVar[str] = "save"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, ModelOutput)
    provides: ClassVar[type] = SaveResult

    connector: KVConnectorWorker | None = None

    @property
    def immediate(self) -> bool:
        """Without a connector there is nothing to wait for (runs before its siblings)."""
        return self.connector is None

    async def run(self, ctx: StepContext) -> SaveResult:
        loads = ctx.maybe(LoadStarted)
        if self.connector is None or loads is None or not loads.started:
            return SaveResult()
        failures = SaveFailures()
        layer_error = ctx.get(ModelOutput).save_error
        if layer_error is not None:
            failures = failures.add(SaveFailureCause.SAVE_KV_LAYER, layer_error)
        failed: frozenset[str] = frozenset()
        raised = False
        try:
            failed = frozenset(await self.connector.wait_for_save())
        except ConnectorLifecycleError:
            raise
        except Exception as exc:  # a failing cache tier costs caching, not the step
            failures = failures.add(SaveFailureCause.WAIT_FOR_SAVE, exc)
            raised = True
        if failures:
            failed |= failed_step_saves(ctx.get(SchedulerOutput))
        return SaveResult(failed_req_ids=failed, failures=failures, wait_raised=raised)
