"""The PNG stage timeline of a step log (``kvstep logs FILE --plot OUT.png --steps A:B``).

One row per graph (the engine, then each worker rank), one bar per stage record, each
stage name in its own colour, x in milliseconds since the first selected record. Dashed
lines mark where each step starts (labelled with its id). Idle time between steps that
is much longer than a step (more than ``3 x`` the median step, and at least 1 ms) is cut
down to one median step and marked with a hatched band saying how long it was, so a
log with pauses between bursts still shows its steps. Uses matplotlib's Agg backend
through its object API (never ``pyplot``, never a window): safe from threads. Needs the
``plot`` extra (``pip install 'kvstep[plot]'``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import InvalidConfigError

__all__ = [
    "IdleCut",
    "TimeAxis",
    "narrow_to_steps",
    "parse_steps",
    "select_steps",
    "stage_colors",
    "write_plot",
]

Record = dict[str, Any]


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """Parse a step range ``A:B`` (A included, B excluded; either may be empty).

    ``None`` or ``""`` selects every step.

    Raises:
        InvalidConfigError: ``text`` is not of the form ``A:B`` with integers A, B.
    """
    if not text:
        return (None, None)
    head, sep, tail = text.partition(":")
    try:
        if not sep:
            raise ValueError(text)
        return (int(head) if head else None, int(tail) if tail else None)
    except ValueError:
        raise InvalidConfigError(
            "--steps", text, "must be A:B with integers (A: or :B too)"
        ) from None


def select_steps(
    records: Sequence[Record], steps: tuple[int | None, int | None], event: str | None = None
) -> list[Record]:
    """The records whose integer ``step_id`` is in ``steps`` (of ``event``, if given)."""
    first, stop = steps
    return [
        r
        for r in records
        if (event is None or r.get("event") == event)
        and isinstance(r.get("step_id"), int)
        and (first is None or r["step_id"] >= first)
        and (stop is None or r["step_id"] < stop)
    ]


def narrow_to_steps(
    records: Sequence[Record], steps: tuple[int | None, int | None]
) -> Sequence[Record]:
    """``records`` narrowed to ``steps`` (all of them when the range is open).

    Raises:
        InvalidConfigError: ``steps`` selects no record of the log.
    """
    if steps == (None, None):
        return records
    selected = select_steps(records, steps)
    if not selected:
        first, stop = steps
        raise InvalidConfigError("--steps", f"{first}:{stop}", "selects no record of the log")
    return selected


def stage_colors(stages: Sequence[str]) -> dict[str, Any]:
    """A distinct colour per stage name (60 before any repeats: tab20, tab20b, tab20c)."""
    from matplotlib import colormaps

    palette = [
        c for name in ("tab20", "tab20b", "tab20c") for c in getattr(colormaps[name], "colors", ())
    ]
    palette = palette or [f"C{i}" for i in range(10)]
    return {stage: palette[i % len(palette)] for i, stage in enumerate(stages)}


@attrs.frozen
class IdleCut:
    """An idle gap cut from the x axis: its start on the cut axis (ms) and real length."""

    at_ms: float
    width_ms: float
    idle_ms: float


@attrs.frozen
class TimeAxis:
    """Maps record times (seconds) to x (ms since ``t0``, idle gaps cut).

    Attributes:
        t0: The first selected start time (seconds).
        gaps: ``(start, end)`` in seconds of each cut idle gap, in order.
        keep_ms: Width each cut gap keeps on the axis.
    """

    t0: float
    gaps: tuple[tuple[float, float], ...]
    keep_ms: float

    @classmethod
    def build(cls, chosen: Sequence[Record]) -> TimeAxis:
        spans = sorted(
            (float(r["start_ts"]), float(r["start_ts"]) + float(r.get("duration_s") or 0))
            for r in chosen
        )
        per_step: dict[int, list[float]] = {}
        for r in chosen:
            start = float(r["start_ts"])
            lo_hi = per_step.setdefault(int(r["step_id"]), [start, start])
            lo_hi[0] = min(lo_hi[0], start)
            lo_hi[1] = max(lo_hi[1], start + float(r.get("duration_s") or 0))
        step_ms = statistics.median(1000 * (hi - lo) for lo, hi in per_step.values())
        keep_ms = max(step_ms, 0.1)
        threshold_s = max(3 * step_ms, 1.0) / 1000
        gaps: list[tuple[float, float]] = []
        busy_end = spans[0][1]
        for start, end in spans[1:]:
            if start - busy_end > threshold_s:
                gaps.append((busy_end, start))
            busy_end = max(busy_end, end)
        return cls(spans[0][0], tuple(gaps), keep_ms)

    def x(self, t: float) -> float:
        """x of time ``t`` (seconds), in ms, with the idle gaps before it cut."""
        shift_s = 0.0
        for start, end in self.gaps:
            if t >= end:
                shift_s += (end - start) - self.keep_ms / 1000
            elif t > start:
                shift_s += min(t - start, (end - start) - self.keep_ms / 1000)
        return (t - self.t0 - shift_s) * 1000

    def cuts(self) -> list[IdleCut]:
        """Where the cut gaps lie on the axis and how long each really was."""
        return [IdleCut(self.x(a), self.keep_ms, (b - a) * 1000) for a, b in self.gaps]


def _step_starts(chosen: Sequence[Record]) -> dict[int, float]:
    starts: dict[int, float] = {}
    for r in chosen:
        step, start = int(r["step_id"]), float(r["start_ts"])
        starts[step] = min(starts.get(step, start), start)
    return dict(sorted(starts.items()))


def write_plot(
    records: Sequence[Record],
    path: str | Path,
    steps: tuple[int | None, int | None] = (None, None),
    width_in: float = 12.0,
) -> int:
    """Draw the stage timeline of the steps in ``steps`` to a PNG at ``path``.

    Blocks while rendering (tens of ms per thousand records).

    Returns:
        The number of stage records drawn (one bar each).

    Raises:
        InvalidConfigError: No stage record falls in ``steps``, or matplotlib is missing.
    """
    chosen = [
        r
        for r in select_steps(records, steps, "stage")
        if isinstance(r.get("start_ts"), int | float)
    ]
    if not chosen:
        first, stop = steps
        raise InvalidConfigError("--steps", f"{first}:{stop}", "selects no stage record of the log")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise InvalidConfigError(
            "--plot", str(path), "needs matplotlib: pip install 'kvstep[plot]'"
        ) from exc

    def row_of(rec: Record) -> str:
        rank = rec.get("rank")
        return "engine" if rec.get("kind") == "engine" or rank is None else f"rank {rank}"

    rows = sorted({row_of(r) for r in chosen}, key=lambda n: (n != "engine", n))
    colors = stage_colors(list(dict.fromkeys(str(r.get("stage")) for r in chosen)))
    axis = TimeAxis.build(chosen)
    figure = Figure(figsize=(width_in, 1.6 + 0.8 * len(rows)), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for stage, color in colors.items():
        labelled = False
        for row_index, row in enumerate(rows):
            spans = []
            for r in chosen:
                if str(r.get("stage")) == stage and row_of(r) == row:
                    start = float(r["start_ts"])
                    x0 = axis.x(start)
                    spans.append((x0, axis.x(start + float(r.get("duration_s") or 0)) - x0))
            if spans:
                ax.broken_barh(
                    spans, (row_index - 0.4, 0.8), facecolors=color,
                    label=None if labelled else stage,
                )  # fmt: skip
                labelled = True
    starts = _step_starts(chosen)
    label_every = max(1, len(starts) // 40)
    for i, (step, start) in enumerate(starts.items()):
        x = axis.x(start)
        ax.axvline(x, color="0.35", linestyle="--", linewidth=0.6, zorder=0)
        if i % label_every == 0:
            ax.text(x, -0.6, str(step), fontsize="x-small", ha="left", va="bottom", color="0.3")
    for cut in axis.cuts():
        ax.axvspan(cut.at_ms, cut.at_ms + cut.width_ms, facecolor="none", hatch="//",
                   edgecolor="0.5", linewidth=0)  # fmt: skip
        ax.text(
            cut.at_ms + cut.width_ms / 2,
            (len(rows) - 1) / 2,
            f"idle {cut.idle_ms:.0f} ms cut",
            fontsize="x-small",
            ha="center",
            va="center",
            rotation=90,
            color="0.2",
            backgroundcolor="white",
        )
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", title="stage")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.4, -0.75)
    cut_note = f"; {len(axis.gaps)} idle gap(s) cut (hatched)" if axis.gaps else ""
    ax.set_xlabel(f"ms since the first selected stage{cut_note}; dashed: step starts")
    step_ids = list(starts)
    ax.set_title(f"kvstep stage timeline, steps {step_ids[0]}..{step_ids[-1]}")
    ax.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(path), format="png")
    return len(chosen)
