"""``schedule``: the scheduler's plan for the step, the first stage of the engine graph.

``execute`` (running the ranks) is :mod:`stages.execute`; ``fan_in`` (merging their
outputs) is :mod:`stages.fan_in`; ``update`` (feeding them back to the scheduler) is
:mod:`stages.update`. :class:`StepLink` is the input artifact ``schedule`` takes under
async scheduling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import anyio
import attrs

from pipeline.artifacts import SchedulerOutput
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    from stages.scheduler.scheduler import Scheduler

__all__ = ["ScheduleStage", "StepLink"]


@attrs.define(eq=False)
class StepLink:
    """How an engine step follows the one before it when steps are scheduled ahead.

    An input artifact of the engine graph under async scheduling
    (``default_engine_graph(..., ahead=True)``): the engine puts one in each step's
    context (:mod:`pipeline.engine.ahead`). ``schedule`` sets ``scheduled`` once the
    step is planned (the engine may then plan the next one), and the engine sets
    ``done`` (with ``failed``) once the step's outputs are applied or its requests
    failed. Mutable by design: it is the hand-over between two steps in flight, and
    belongs to the one step whose context holds it.

    Attributes:
        previous: The step planned before this one, while it may still run; ``schedule``
            drops the reference once it has waited for it.
        scheduled: Set once this step is planned (or ended without a plan).
        done: Set once this step's outputs are applied, or its requests failed.
        failed: This step's body failed (set before ``done``).
        waited_s: How long ``schedule`` waited for the previous step (step log).
        on_plan: Called once the step is planned ahead and once it is resolved: the
            engine publishes the KV events of that planning then, not only when the
            step ends, so a subscriber sees the cache as it is while steps overlap.
    """

    previous: StepLink | None = None
    scheduled: anyio.Event = attrs.field(factory=anyio.Event)
    done: anyio.Event = attrs.field(factory=anyio.Event)
    failed: bool = False
    waited_s: float = 0.0
    on_plan: Callable[[], object] | None = None

    def finish(self, *, failed: bool) -> None:
        """The step ended (applied, or failed): wake whoever waits for it. Idempotent;
        a failure once recorded stays."""
        self.previous = None
        self.failed = self.failed or failed
        self.scheduled.set()
        self.done.set()


@attrs.frozen
class ScheduleStage:
    """Runs the scheduler: which requests advance this step and by how many tokens.

    With ``ahead`` (the engine's async scheduling) it requires the step's
    :class:`StepLink` (an input of the engine graph): the step is planned at once,
    possibly while the previous step still runs; the stage then waits for that step to
    be applied and returns the plan resolved against it
    (:meth:`Scheduler.resolve_ahead <stages.scheduler.scheduler.Scheduler.resolve_ahead>`:
    placeholders filled in, ended requests out). Its duration in the step log then
    includes that wait (``StepLink.waited_s``). Without a previous step in the link it
    plans as without ``ahead``.

    Args:
        scheduler: The engine's scheduler.
        ahead: Take the step's :class:`StepLink` and plan ahead of the previous step.
    """

    name: ClassVar[str] = "schedule"
    provides: ClassVar[type] = SchedulerOutput

    scheduler: Scheduler
    ahead: bool = attrs.field(default=False, kw_only=True)

    @property
    def requires(self) -> tuple[type, ...]:
        """``(StepLink,)`` when planning ahead, else nothing."""
        return (StepLink,) if self.ahead else ()

    async def run(self, ctx: StepContext) -> SchedulerOutput:
        link = ctx.get(StepLink) if self.ahead else None
        previous = None if link is None else link.previous
        output = self.scheduler.schedule(ahead=previous is not None)
        if link is None:
            return output
        link.scheduled.set()
        link.previous = None
        if previous is None:
            return output
        if link.on_plan is not None:
            link.on_plan()
        if not previous.done.is_set():
            start = time.perf_counter()
            await previous.done.wait()
            link.waited_s = time.perf_counter() - start
        resolved = self.scheduler.resolve_ahead(output, previous_failed=previous.failed)
        if link.on_plan is not None:
            link.on_plan()
        return resolved
