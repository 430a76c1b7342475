"""A no-op stage for the benchmarks that time the step machinery without a model."""

from __future__ import annotations

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
