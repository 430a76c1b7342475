"""Tools over a step log (the JSONL file :class:`~pipeline.steplog.StepLog` writes): a
per-stage summary, a Chrome/Perfetto trace and a timeline plot (``kvstep logs``)."""

from __future__ import annotations

from pipeline.steplog_tools.summary import (
    LogSummary,
    StageStats,
    load_step_log,
    parse_steps,
    print_summary,
    summarize,
    trace_events,
    write_plot,
    write_trace,
)

__all__ = [
    "LogSummary",
    "StageStats",
    "load_step_log",
    "parse_steps",
    "print_summary",
    "summarize",
    "trace_events",
    "write_plot",
    "write_trace",
]
