"""Async scheduling: engine steps planned one ahead of the step that runs.

:class:`StepsAhead` keeps at most two engine steps in flight. Step N+1 starts (and is
planned: the scheduler counts N's sampled tokens as placeholders) as soon as step N is
planned; its ``schedule`` stage then waits until N's outputs are applied and resolves
its plan against them (:mod:`stages.scheduler.lookahead`), so N+1's workers see the same
batch, tokens and seeds as without it. The two steps meet through N+1's
:class:`~stages.schedule.StepLink`, an input of the engine graph
(``default_engine_graph(..., ahead=True)``) that ``schedule`` requires. While N+1's
forward pass runs, the loop hands N's outputs to their streams and plans N+2. Every step
still runs its whole graph, one after the other on each rank: ``clear`` runs once per
step per rank, last; fan-in and the failure of a step are those of the step alone.
"""

from __future__ import annotations

from collections import deque

import anyio
from anyio.abc import TaskGroup

from pipeline.artifacts import EngineStepOutput
from pipeline.engine.core import EngineCore
from stages.schedule import StepLink

__all__ = ["StepLoopError", "StepsAhead", "unwrap_loop_error"]

MAX_IN_FLIGHT = 2
"""Engine steps in flight at once: the one that runs and the one planned after it."""


class StepLoopError(Exception):
    """Carries a step's error out of the task group that ran it (unwrapped by the loop)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


def unwrap_loop_error(group: BaseExceptionGroup) -> BaseException:
    """The step error a task group's exception group carries, else the group itself."""
    for exc in group.exceptions:
        if isinstance(exc, StepLoopError):
            return exc.error
        if isinstance(exc, BaseExceptionGroup):
            inner = unwrap_loop_error(exc)
            if inner is not exc:
                return inner
    return group


class _Flight:
    """One engine step started by :class:`StepsAhead`."""

    __slots__ = ("error", "finished", "link", "result")

    def __init__(self, link: StepLink) -> None:
        self.link = link
        self.finished = anyio.Event()
        self.result: EngineStepOutput | None = None
        self.error: Exception | None = None


class StepsAhead:
    """Engine steps in flight, oldest first, each a task of ``task_group``.

    Results come back in step order (:meth:`next_result`). A step that raised (the
    engine cannot go on: scheduler failure, a dead rank) raises there, in its turn.
    """

    def __init__(self, core: EngineCore, task_group: TaskGroup) -> None:
        self._core = core
        self._tg = task_group
        self._flights: deque[_Flight] = deque()

    @property
    def running(self) -> bool:
        """Whether a step is in flight."""
        return bool(self._flights)

    def can_start(self) -> bool:
        """Whether another step may start (fewer than :data:`MAX_IN_FLIGHT` in flight)."""
        return len(self._flights) < MAX_IN_FLIGHT

    async def start(self) -> None:
        """Start the next step; return once it is planned."""
        previous = self._flights[-1].link if self._flights else None
        flight = _Flight(StepLink(previous=previous, on_plan=self._core.publish_kv_events))
        self._flights.append(flight)
        self._tg.start_soon(self._run, flight)
        await flight.link.scheduled.wait()

    async def _run(self, flight: _Flight) -> None:
        try:
            flight.result = await self._core.step(flight.link)
        except Exception as exc:
            flight.error = exc
            flight.link.finish(failed=True)
        finally:  # also when the step ended before it was planned (a dead rank)
            flight.link.finish(failed=False)
            flight.finished.set()

    async def next_result(self) -> EngineStepOutput:
        """Wait for the oldest step in flight; its output, or its error raised."""
        flight = self._flights[0]
        await flight.finished.wait()
        self._flights.popleft()
        if flight.error is not None:
            raise flight.error
        assert flight.result is not None
        return flight.result
