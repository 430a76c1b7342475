"""``bind``: open the connector's step and hand it this step's metadata."""

from __future__ import annotations

from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import MetadataBound, SchedulerOutput
from pipeline.kernel.context import StepContext

__all__ = ["BindStage"]


@attrs.frozen
class BindStage:
    """Opens the connector's step and binds ``SchedulerOutput.kv_connector_metadata``.

    With a connector it calls ``begin_step`` on every step (the lifecycle guard checks
    that the previous step was cleared), then binds the step's metadata unless it is
    ``None``. Without a connector it does nothing. The ``clear`` finalizer runs either
    way. Synchronous work only: no cancellation point.
    """

    name: ClassVar[str] = "bind"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput,)
    provides: ClassVar[type] = MetadataBound

    connector: KVConnectorWorker | None = None

    async def run(self, ctx: StepContext) -> MetadataBound:
        if self.connector is None:
            return MetadataBound(False)
        scheduler_output = ctx.get(SchedulerOutput)
        self.connector.begin_step(scheduler_output.step_id)
        metadata = scheduler_output.kv_connector_metadata
        if metadata is None:
            return MetadataBound(False)
        self.connector.bind_connector_metadata(metadata)
        return MetadataBound(True)
