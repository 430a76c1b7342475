"""A no-op stage, and a step timer, for the benchmarks that time the step machinery without
a model."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Coroutine
from time import perf_counter_ns
from typing import Any

import attrs

from pipeline.kernel.context import StepContext


@attrs.frozen
class NoopStage:
    """Reads its inputs from the context and returns a preallocated artifact."""

    name: str
    requires: tuple[type, ...]
    provides: type
    out: object

    async def run(self, ctx: StepContext) -> Any:
        for t in self.requires:
            ctx.get(t)
        return self.out


async def median_us(step: Callable[[StepContext], Coroutine[Any, Any, Any]], steps: int) -> float:
    """Median wall time of one step, in µs, after a warm-up."""
    for i in range(min(steps, 500)):
        await step(StepContext(i))
    samples = []
    for i in range(steps):
        ctx = StepContext(i)
        t0 = perf_counter_ns()
        await step(ctx)
        samples.append(perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0
