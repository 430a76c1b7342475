"""Chrome trace-event export of a step log (``kvstep logs FILE --trace OUT.json``).

The output opens in Perfetto (ui.perfetto.dev) and chrome://tracing. Layout:

* one process per worker rank (``pid = rank``) and one for the engine
  (``pid = ENGINE_PID``), named by ``process_name`` metadata events (``"ph": "M"``);
* in each process, thread ``0`` holds one slice per step and thread ``i >= 1`` the
  slices of the ``i``-th stage name seen in that process (``thread_name`` metadata);
* every stage and step record is a complete event (``"ph": "X"``) with ``ts`` and
  ``dur`` in microseconds since the earliest record;
* every request is an async slice (``"ph": "b"`` / ``"e"``, ``cat="request"``, ``id``)
  in the engine process, from the request's arrival to the end of the step that
  finished it (or the end of the log). Arrival comes from the ``request_times`` field
  of the engine step record that finished it (``[arrival, first_scheduled,
  first_token]`` unix times); the begin event's args carry ``queue_s`` (arrival to
  first scheduled) and ``ttft_s``. A log without ``request_times`` (older kvstep), or
  a request that never finished, starts at the engine step that first scheduled it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.steplog_tools.plot import narrow_to_steps

__all__ = ["ENGINE_PID", "trace_events", "write_trace"]

ENGINE_PID = 1_000_000
"""The engine's process id in the trace (worker ranks use their rank)."""

Record = dict[str, Any]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def trace_events(records: Sequence[Record]) -> list[dict[str, Any]]:
    """The trace events of step-log records (see the module docstring for the layout)."""
    timed = [r for r in records if isinstance(r.get("start_ts"), int | float)]
    if not timed:
        return []
    t0 = min(float(r["start_ts"]) for r in timed)
    for rec in timed:  # a request may arrive before the first step of the log
        for times in _times_of(rec).values():
            t0 = min(t0, times[0])
    events: list[dict[str, Any]] = []
    tids: dict[int, dict[str, int]] = {}

    def pid_of(rec: Record) -> int:
        rank = rec.get("rank")
        return ENGINE_PID if rec.get("kind") == "engine" or not isinstance(rank, int) else rank

    for rec in timed:
        pid = pid_of(rec)
        threads = tids.setdefault(pid, {})
        start = float(rec["start_ts"]) - t0
        dur = max(0.0, float(rec.get("duration_s") or 0.0))
        args: dict[str, Any] = {k: rec.get(k) for k in ("step_id", "outcome") if k in rec}
        if rec.get("event") == "stage":
            name = str(rec.get("stage"))
            tid = threads.setdefault(name, len(threads) + 1)
            args.update(finalizer=bool(rec.get("finalizer")), error=rec.get("error"))
        else:
            name = f"step {rec.get('step_id')}"
            tid = 0
            for key in ("batch_size", "num_tokens", "loaded_tokens", "saved_tokens",
                        "failed_stage"):  # fmt: skip
                if key in rec:
                    args[key] = rec[key]
        events.append(
            {"name": name, "cat": str(rec.get("kind")), "ph": "X", "pid": pid, "tid": tid,
             "ts": _us(start), "dur": _us(dur), "args": args}
        )  # fmt: skip
    events.extend(_request_events(timed, t0))
    meta: list[dict[str, Any]] = []
    for pid, threads in sorted(tids.items()):
        pname = "engine" if pid == ENGINE_PID else f"rank {pid}"
        sort_index = -1 if pid == ENGINE_PID else pid
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": pname}})  # fmt: skip
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": sort_index}})  # fmt: skip
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": "steps"}})  # fmt: skip
        for stage, tid in threads.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"name": stage}})  # fmt: skip
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"sort_index": tid}})  # fmt: skip
    return meta + events


def _request_events(records: Sequence[Record], t0: float) -> list[dict[str, Any]]:
    """Balanced b/e pairs for the requests of the engine step records, in file order.

    A request id seen again after it finished (a second engine on the same log) opens
    a new slice with the id suffixed ``#2``, ``#3``, ...
    """
    events: list[dict[str, Any]] = []
    open_ids: dict[str, str] = {}
    uses: dict[str, int] = {}
    begins: dict[str, dict[str, Any]] = {}
    end = 0.0
    for rec in records:
        if rec.get("event") != "step" or rec.get("kind") != "engine":
            continue
        start = float(rec["start_ts"]) - t0
        stop = start + max(0.0, float(rec.get("duration_s") or 0.0))
        end = max(end, stop)
        for req in rec.get("requests") or ():
            req = str(req)
            if req not in open_ids:
                uses[req] = uses.get(req, 0) + 1
                trace_id = req if uses[req] == 1 else f"{req}#{uses[req]}"
                open_ids[req] = trace_id
                begins[trace_id] = _async("b", trace_id, req, start, rec.get("step_id"))
                events.append(begins[trace_id])
        times = _times_of(rec)
        for req in rec.get("finished") or ():
            if str(req) in open_ids:
                trace_id = open_ids.pop(str(req))
                begin = begins.pop(trace_id)
                known = times.get(str(req))
                if known is not None:
                    arrival, scheduled, first_token = known
                    begin["ts"] = _us(min(arrival - t0, begin["ts"] / 1e6))
                    if scheduled is not None:
                        begin["args"]["queue_s"] = round(max(0.0, scheduled - arrival), 6)
                    if first_token is not None:
                        begin["args"]["ttft_s"] = round(max(0.0, first_token - arrival), 6)
                events.append(_async("e", trace_id, str(req), stop, rec.get("step_id")))
    for req, trace_id in open_ids.items():
        events.append(_async("e", trace_id, req, end, None))
    return events


def _times_of(rec: Record) -> dict[str, tuple[float, float | None, float | None]]:
    """The well-formed ``request_times`` entries of an engine step record."""
    raw = rec.get("request_times")
    if rec.get("event") != "step" or rec.get("kind") != "engine" or not isinstance(raw, dict):
        return {}
    times: dict[str, tuple[float, float | None, float | None]] = {}
    for req, value in raw.items():
        if not isinstance(value, list | tuple) or len(value) < 3:
            continue
        if not all(v is None or isinstance(v, int | float) for v in value[:3]):
            continue
        arrival, scheduled, first_token = value[:3]
        if arrival is None:
            continue
        times[str(req)] = (
            float(arrival),
            None if scheduled is None else float(scheduled),
            None if first_token is None else float(first_token),
        )
    return times


def _async(ph: str, trace_id: str, req: str, ts: float, step_id: Any) -> dict[str, Any]:
    return {"name": f"request {req}", "cat": "request", "ph": ph, "id": trace_id,
            "pid": ENGINE_PID, "tid": 0, "ts": _us(ts), "args": {"step_id": step_id}}  # fmt: skip


def write_trace(
    records: Sequence[Record],
    path: str | Path,
    *,
    steps: tuple[int | None, int | None] = (None, None),
) -> int:
    """Write the trace of ``records`` as ``{"traceEvents": [...]}`` JSON; return #events.

    ``steps`` (``A:B`` as :func:`~pipeline.steplog_tools.plot.parse_steps` returns it)
    keeps only the records of those steps, as the summary and the plot do: a request
    whose finishing step is outside the range ends at the range's last step.
    Blocks on the file write; creates parent folders.

    Raises:
        InvalidConfigError: ``steps`` selects no record of the log.
    """
    events = trace_events(narrow_to_steps(records, steps))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)
