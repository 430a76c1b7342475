"""``bind``: hand this step's connector metadata to the worker-side connector."""

from __future__ import annotations

from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import MetadataBound, SchedulerOutput
from pipeline.kernel.context import StepContext

__all__ = ["BindStage"]


@attrs.frozen
class BindStage:
    """Binds ``SchedulerOutput.kv_connector_metadata`` on this rank's connector.

    Without a connector (or on a step whose metadata is ``None``) it binds nothing; the
    ``clear`` finalizer runs either way.
    """

    name: ClassVar[str] = "bind"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput,)
    provides: ClassVar[type] = MetadataBound

    connector: KVConnectorWorker | None = None

    async def run(self, ctx: StepContext) -> MetadataBound:
        metadata = ctx.get(SchedulerOutput).kv_connector_metadata
        if self.connector is None or metadata is None:
            return MetadataBound(False)
        self.connector.bind_connector_metadata(metadata)
        return MetadataBound(True)
