"""``clear``: the mandatory finalizer that always clears the connectors' step metadata.

This is the stage kvstep exists for. It runs after the worker graph's body on success,
error, cancellation and timeout. Its critical part is plain synchronous code in the
innermost ``finally`` of the runner, one ``try`` per connector, so neither a failing drain
nor a second native ``task.cancel()`` can skip it. Running it twice in one step is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.errors import FinalizerError
from pipeline.kernel.context import StepContext
from pipeline.kernel.stage import Finalizer
from pipeline.logger import get_logger

__all__ = ["ClearConnectorStage"]

_log = get_logger()
_CLEARED = "clear.done"


@attrs.frozen
class ClearConnectorStage(Finalizer):
    """Calls ``clear_connector_metadata`` on every connector of this rank, once per step.

    It has nothing to drain (``wait_for_save`` ran in the body, or the step failed), so
    it inherits the no-op ``run`` and the runner skips the shielded await entirely.
    """

    name: ClassVar[str] = "clear"
    mandatory: ClassVar[bool] = True

    connectors: Sequence[KVConnectorWorker] = ()
    timeout_s: float = 30.0

    def finalize(self, ctx: StepContext) -> None:
        if ctx.scratch.get(_CLEARED):
            return
        ctx.scratch[_CLEARED] = True
        failures: dict[str, BaseException] = {}
        for index, connector in enumerate(self.connectors):
            try:
                connector.clear_connector_metadata()
            except Exception as exc:  # each connector in its own try: one failing clears the rest
                failures[f"clear[{index}]"] = exc
                _log.error("connector_clear_failed", step_id=ctx.step_id, error=repr(exc))
        if failures:
            raise FinalizerError(ctx.step_id, failures)
