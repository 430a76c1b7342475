"""The PNG stage timeline of a step log (``kvstep logs FILE --plot OUT.png --steps A:B``).

One row per graph (the engine, then each worker rank), one bar per stage record, colored
by stage name, x in milliseconds since the first selected record. Uses matplotlib's Agg
backend through its object API (never ``pyplot``, never a window): safe from threads.
Needs the ``plot`` extra (``pip install 'kvstep[plot]'``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidConfigError

__all__ = ["parse_steps", "write_plot"]

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


def write_plot(
    records: Sequence[Record],
    path: str | Path,
    steps: tuple[int | None, int | None] = (None, None),
    width_in: float = 12.0,
) -> int:
    """Draw the stage timeline of the steps in ``steps`` to a PNG at ``path``.

    Blocks while rendering (tens of ms per thousand records).

    Returns:
        The number of stage records drawn.

    Raises:
        InvalidConfigError: No stage record falls in ``steps``, or matplotlib is missing.
    """
    first, stop = steps
    chosen = [
        r
        for r in records
        if r.get("event") == "stage"
        and isinstance(r.get("step_id"), int)
        and isinstance(r.get("start_ts"), int | float)
        and (first is None or r["step_id"] >= first)
        and (stop is None or r["step_id"] < stop)
    ]
    if not chosen:
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
    stages = list(dict.fromkeys(str(r.get("stage")) for r in chosen))
    t0 = min(float(r["start_ts"]) for r in chosen)
    figure = Figure(figsize=(width_in, 1.2 + 0.8 * len(rows)), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(stages))]
    for i, stage in enumerate(stages):
        labelled = False
        for row_index, row in enumerate(rows):
            spans = [
                ((float(r["start_ts"]) - t0) * 1000, float(r.get("duration_s") or 0) * 1000)
                for r in chosen
                if str(r.get("stage")) == stage and row_of(r) == row
            ]
            if spans:
                ax.broken_barh(
                    spans, (row_index - 0.4, 0.8), facecolors=colors[i],
                    label=None if labelled else stage,
                )  # fmt: skip
                labelled = True
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", title="stage")
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first selected stage")
    step_ids = [int(r["step_id"]) for r in chosen]
    ax.set_title(f"kvstep stage timeline, steps {min(step_ids)}..{max(step_ids)}")
    ax.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(path), format="png")
    return len(chosen)
