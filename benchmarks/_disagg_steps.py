"""Part 3's server side: what the decode engine's step log says about its steps in the
rounds' windows (``benchmarks/disagg.py --step-logs``).

A decode stream gets one token per engine step, so its client-side ITL is the engine's
step period (start to next start) plus whatever the relay adds. The period splits into
the step itself (``duration``: schedule, execute, fan_in, update) and the ``gap`` between
one step's end and the next one's start (the loop serving HTTP, admitting, or waiting
for a core). Compared loaded against no-load, it says whether a loaded ITL tail is the
engine's own work, the loop's, or neither (then it is on the way to the client).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from _serve_metrics import SAMPLE_QUANTILE

__all__ = ["summarize"]

_STREAM_STEPS = 16  # a request in this many steps is a decode stream, not a long prompt


class _Window(Protocol):
    @property
    def start_ts(self) -> float: ...
    @property
    def end_ts(self) -> float: ...


def _p(samples: Sequence[float], q: float) -> float:
    if not samples:
        return float("nan")
    return float(np.quantile(samples, q, method=SAMPLE_QUANTILE))


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(_p(values, 0.5), 2),
        "p99": round(_p(values, 0.99), 2),
        "max": round(max(values, default=float("nan")), 2),
    }


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a half-written last line
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def summarize(path: Path, windows: Iterable[_Window]) -> dict[str, Any]:
    """The engine steps of the step log at ``path`` that started inside ``windows``:
    count, p50/p99/max of their duration, period and gap (ms), p99 of each engine and
    worker stage (ms), and the five longest periods with their duration, gap, tokens,
    batch size and the stage that took longest."""
    records = _records(path)
    spans = sorted((w.start_ts, w.end_ts) for w in windows)

    def inside(ts: float) -> bool:
        return any(a <= ts <= b for a, b in spans)

    steps = sorted(
        (r for r in records if r.get("event") == "step" and r.get("kind") == "engine"),
        key=lambda r: float(r["start_ts"]),
    )
    stages: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("event") == "stage" and r.get("kind") in ("engine", "worker"):
            stages.setdefault((r["kind"], r["step_id"]), []).append(r)
    seen: dict[str, int] = {}
    for step in steps:
        for req_id in step.get("requests", ()):
            seen[req_id] = seen.get(req_id, 0) + 1
    streams = {r for r, n in seen.items() if n >= _STREAM_STEPS}
    rows: list[dict[str, Any]] = []
    for prev, step in itertools.pairwise(steps):
        if not (inside(prev["start_ts"]) and inside(step["start_ts"])):
            continue
        ids = set(prev.get("requests", ()))
        if not ids & streams & set(step.get("requests", ())):
            continue  # no stream has a token in both steps: no ITL sample spans the two
        if prev.get("loaded_tokens"):
            what = "read_done"
        elif ids - streams:
            what = "with_prefill"
        else:
            what = "decode_only"
        period = step["start_ts"] - prev["start_ts"]
        own = stages.get(("engine", prev["step_id"]), [])
        longest = max(own, key=lambda s: s["duration_s"], default=None)
        rows.append(
            {
                "period_ms": period * 1e3,
                "duration_ms": prev["duration_s"] * 1e3,
                "gap_ms": (period - prev["duration_s"]) * 1e3,
                "tokens": prev.get("num_tokens", 0),
                "batch": prev.get("batch_size", 0),
                "longest_stage": longest["stage"] if longest else "",
                "kind": what,
                "step_id": prev["step_id"],
            }
        )
    out: dict[str, Any] = {"steps": len(rows)}
    for key in ("period_ms", "duration_ms", "gap_ms"):
        out[key] = _spread([row[key] for row in rows])
    out["period_ms_by_kind"] = {
        what: {"steps": len(v), **_spread(v)}
        for what in ("decode_only", "with_prefill", "read_done")
        for v in [[row["period_ms"] for row in rows if row["kind"] == what]]
    }
    ids = {row["step_id"] for row in rows}
    per_stage: dict[str, list[float]] = {}
    for (kind, step_id), recs in stages.items():
        if step_id in ids:
            for s in recs:
                per_stage.setdefault(f"{kind}.{s['stage']}", []).append(s["duration_s"] * 1e3)
    out["stage_p99_ms"] = {k: round(_p(v, 0.99), 2) for k, v in sorted(per_stage.items())}
    slowest = sorted(rows, key=lambda row: -row["period_ms"])[:5]
    out["slowest"] = [{k: v for k, v in row.items() if k != "step_id"} for row in slowest]
    for row in out["slowest"]:
        for key in ("period_ms", "duration_ms", "gap_ms"):
            row[key] = round(row[key], 2)
    return out
