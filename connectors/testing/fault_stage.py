"""``FaultStage``: a stage that raises, hangs or is cancelled at a chosen step and rank.

Insert it anywhere in a worker or engine graph; ``requires`` places it (it runs once
those artifacts exist, concurrently with the other stages that need them)::

    fault = FaultStage(action="raise", requires=(ModelOutput,), step=3, rank=1)
    AsyncEngine(config, worker_graph=lambda g: g.insert_after("forward", fault))

By default it provides nothing (``provides=None``), so no stage waits for it; pass a
marker class of your own as ``provides`` (built with no arguments) to make later
stages depend on it. Give each instance in one graph its own ``name``.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import attrs

from connectors.testing.fault_spec import cancel_current_task, check_hang_s
from pipeline.checks import check_int
from pipeline.errors import FaultInjected, InvalidConfigError
from pipeline.kernel.context import StepContext

__all__ = ["FaultStage"]

_ACTIONS = ("raise", "hang", "cancel")


class _Budget:
    """How many more times a stage may fire; thread-safe (graphs may share a stage)."""

    def __init__(self, times: int | None) -> None:
        self._left = times
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._left is None:
                return True
            if self._left == 0:
                return False
            self._left -= 1
            return True


def _check(inst: FaultStage, attribute: attrs.Attribute[Any], value: Any) -> None:
    name = attribute.name
    if name == "action" and value not in _ACTIONS:
        raise InvalidConfigError("fault action", value, f"a stage allows: {', '.join(_ACTIONS)}")
    if name in ("step", "rank", "times"):
        low = 1 if name == "times" else 0
        check_int(f"fault {name}", value, InvalidConfigError, lo=low, optional=True)
    if name == "hang_s":
        check_hang_s(value)
    if name == "provides" and value is not None and not isinstance(value, type):
        raise InvalidConfigError("fault provides", value, "must be None or a marker class")


@attrs.frozen(kw_only=True)
class FaultStage:
    """Injects a fault when it runs in step ``step`` on rank ``rank``; else passes.

    Attributes:
        action: ``"raise"`` (:class:`~pipeline.errors.FaultInjected` naming the stage),
            ``"hang"`` (``await anyio.sleep(hang_s)``, then pass: a deadline cuts it) or
            ``"cancel"`` (a native ``task.cancel()`` of the asyncio task running the
            stage; under trio it raises ``FaultInjected`` instead).
        name: The stage's name, unique within its graph.
        requires: Artifact types it waits for (this is what places it in the graph).
        provides: ``None``, or a marker class built with no arguments when it passes.
        step: Fire only in this step; ``None``: every step.
        rank: Fire only on this rank (``ctx.rank``; ``None`` on the engine graph);
            ``None``: every rank.
        times: Fire at most this many times (default 1) in all, over every graph this
            instance is in (a ``worker_graph`` function shares one instance across
            ranks); ``None``: every match.
        hang_s: Seconds a ``"hang"`` waits.
        fired: ``(step_id, rank)`` of each firing, in order (not an init argument).

    Cancellation-safe: a step cancelled while it hangs is cancelled at the sleep.

    Raises:
        InvalidConfigError: On construction, naming the bad field and what is allowed.
    """

    action: str = attrs.field(validator=_check)
    name: str = "fault"
    requires: tuple[type, ...] = attrs.field(default=(), converter=tuple)
    provides: type | None = attrs.field(default=None, validator=_check)
    step: int | None = attrs.field(default=None, validator=_check)
    rank: int | None = attrs.field(default=None, validator=_check)
    times: int | None = attrs.field(default=1, validator=_check)
    hang_s: float = attrs.field(default=60.0, validator=_check)
    fired: list[tuple[int, int | None]] = attrs.field(init=False, factory=list, eq=False)
    _budget: _Budget = attrs.field(init=False, eq=False, repr=False)

    @_budget.default
    def _make_budget(self) -> _Budget:
        return _Budget(self.times)

    async def run(self, ctx: StepContext) -> Any:
        """Fire if ``step`` and ``rank`` match and firings are left; else pass."""
        fires = (
            (self.step is None or self.step == ctx.step_id)
            and (self.rank is None or self.rank == ctx.rank)
            and self._budget.take()
        )
        if fires:
            self.fired.append((ctx.step_id, ctx.rank))
            call = f"stage {self.name}"
            if self.action == "raise":
                raise FaultInjected(call, ctx.step_id, ctx.rank)
            if self.action == "cancel":
                await cancel_current_task(call, ctx.step_id, ctx.rank)
            await anyio.sleep(self.hang_s)
        return None if self.provides is None else self.provides()
