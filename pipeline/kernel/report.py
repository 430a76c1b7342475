"""What the runner observed of one step: per-stage timings and outcomes.

The runner fills a :class:`StepReport` on every step, on success and failure alike, and
stores it in ``ctx.report``; the engine hands it to the step log. Reports are plain frozen
data, cheap to build and safe to share between threads.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import attrs

from pipeline.errors import GraphError

__all__ = ["StageOutcome", "StageRecord", "StepOutcome", "StepReport"]

StepOutcome = Literal["ok", "error", "cancelled"]
"""How a step's body ended."""

StageOutcome = Literal["ok", "error", "cancelled", "skipped"]
"""How one stage ended; ``skipped``: it never started because the body failed first."""


class StageRecord(NamedTuple):
    """One stage (or finalizer) of one step.

    A NamedTuple rather than an attrs class: the runner builds one per stage per step,
    and a tuple is built several times faster. Treat it as a record (use the names).

    Attributes:
        name: The stage name.
        outcome: ``ok``, ``error`` (it raised), ``cancelled`` (it was cancelled, or, for
            a finalizer, its drain was cut at ``timeout_s``) or ``skipped``.
        start_s: When it started, in seconds since the step started (0.0 if skipped).
        duration_s: How long it ran, in seconds (0.0 if skipped).
        finalizer: Whether it is a finalizer.
        error: ``"ExcType: message"`` when it raised, the reason when a finalizer's drain
            was cut, else ``None``.
    """

    name: str
    outcome: StageOutcome
    start_s: float
    duration_s: float
    finalizer: bool
    error: str | None


@attrs.frozen
class StepReport:
    """The runner's account of one step on one rank.

    Attributes:
        step_id: The step number.
        rank: The worker rank, ``None`` on the engine side.
        outcome: How the body ended: ``ok``, ``error`` or ``cancelled`` (including an
            enclosing timeout). Finalizer failures do not change it.
        duration_s: Wall time of the whole step (body and finalizers), in seconds.
        stages: One record per body stage (in topological order), then one per
            finalizer (in the order they ran, i.e. reversed declaration order).
        failed_stage: The body stage whose exception failed the step (the earliest to
            fail), ``None`` if none failed.
        finalizer_failures: Names of the finalizers whose drain or ``finalize`` raised.
        start_ts: Wall-clock start of the step (``time.time()``), for timelines.
    """

    step_id: int
    rank: int | None
    outcome: StepOutcome
    duration_s: float
    stages: tuple[StageRecord, ...]
    failed_stage: str | None
    finalizer_failures: tuple[str, ...]
    start_ts: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the body succeeded and no finalizer failed."""
        return self.outcome == "ok" and not self.finalizer_failures

    def stage(self, name: str) -> StageRecord:
        """Return the record of the stage called ``name``.

        Raises:
            GraphError: No stage of that name in this step (the names are listed).
        """
        for record in self.stages:
            if record.name == name:
                return record
        names = ", ".join(r.name for r in self.stages) or "none"
        raise GraphError(
            f"no stage {name!r} in the report of step {self.step_id}; stages: {names}",
            stage=name,
        )
