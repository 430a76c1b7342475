"""``load``: start the connector's KV loads; they overlap the forward pass layer by layer."""

from __future__ import annotations

from typing import ClassVar, Protocol

import attrs

from connectors.base import ForwardContext, KVConnectorWorker
from pipeline.artifacts import LoadStarted, MetadataBound, SchedulerOutput
from pipeline.kernel.context import StepContext

__all__ = ["LoadStage"]


class _HasForwardContext(Protocol):
    def forward_context(self, scheduler_output: SchedulerOutput) -> ForwardContext: ...


@attrs.frozen
class LoadStage:
    """Calls ``start_load_kv`` once per step when metadata was bound.

    The forward pass then calls ``wait_for_layer_load(i)`` before layer ``i``'s attention,
    so compute of the first layers starts before the last layers' KV has arrived.
    """

    name: ClassVar[str] = "load"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, MetadataBound)
    provides: ClassVar[type] = LoadStarted

    runner: _HasForwardContext
    connector: KVConnectorWorker | None = None

    async def run(self, ctx: StepContext) -> LoadStarted:
        if self.connector is None or not ctx.get(MetadataBound).bound:
            return LoadStarted(False)
        await self.connector.start_load_kv(self.runner.forward_context(ctx.get(SchedulerOutput)))
        return LoadStarted(True)
