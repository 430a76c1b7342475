"""An executor for stage tests: its ranks are the given async callables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.errors import WorkerDiedError
from stages.execute import SubmittedStep


@attrs.define
class FakeRanks:
    """An executor (the ``Executor`` protocol) whose ranks are the given async callables;
    ``submitted`` lists the step ids it was handed."""

    waiters: Sequence[Any]
    request_errors: dict[str, str] = attrs.field(factory=dict)
    name: str = "fake"
    failure: WorkerDiedError | None = None
    submitted: list[int] = attrs.field(factory=list)

    @property
    def world_size(self) -> int:
        return len(self.waiters)

    def submit(self, scheduler_output: SchedulerOutput) -> SubmittedStep:
        self.submitted.append(scheduler_output.step_id)
        return SubmittedStep(tuple(self.waiters), self.request_errors)

    def check_alive(self) -> WorkerDiedError | None:
        return self.failure

    def bound_metadata(self) -> int:
        return 0

    async def shutdown(self) -> None:
        return None


def hang() -> Any:
    """A rank that never answers (until cancelled at the deadline)."""

    async def waiter() -> WorkerOutput:
        await anyio.sleep(30)
        raise AssertionError("unreachable")

    return waiter
