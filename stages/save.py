"""``save``: wait until this step's KV saves are durable (or have failed, reported)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import LoadStarted, ModelOutput, SaveResult
from pipeline.kernel.context import StepContext

__all__ = ["SaveStage"]


@attrs.frozen
class SaveStage:
    """Calls ``wait_for_save`` after the forward pass has issued its per-layer saves.

    Failed saves are data, not exceptions: their request ids travel to the scheduler in
    the ``WorkerOutput`` so their blocks are released and the engine keeps serving.
    """

    name: ClassVar[str] = "save"
    requires: ClassVar[tuple[type, ...]] = (ModelOutput,)
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
        return SaveResult(failed_req_ids=frozenset(await self.connector.wait_for_save()))
