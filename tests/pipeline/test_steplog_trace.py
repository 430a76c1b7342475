"""Chrome trace-event export of a step log (pipeline.steplog_tools.trace), event by event."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.steplog_tools.summary import load_step_log
from pipeline.steplog_tools.trace import ENGINE_PID, trace_events, write_trace

PHASES = {"X", "M", "b", "e"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


_LONGEST: list[str] = []  # the request id of the max_tokens=5 request of ``records``


@pytest.fixture
def records(tmp_path: Path) -> list[dict[str, Any]]:
    """Step-log records of a 2-rank engine: 3 requests of different lengths."""
    path = tmp_path / "steps.jsonl"
    with LLM(EngineConfig(max_model_len=128, step_log=str(path), world_size=2)) as llm:
        params = [SamplingParams(max_tokens=n, temperature=0) for n in (2, 5, 3)]
        outs = llm.generate([[1, 2, 3], [4, 5, 6, 7], [9] * 18], params)
    _LONGEST[:] = [outs[1].request_id]
    return load_step_log(path)


def _validate(events: list[dict[str, Any]]) -> None:
    """Check every event against the trace-event format; fail with the bad event."""
    open_async: Counter[tuple[str, str]] = Counter()
    for ev in events:
        assert ev["ph"] in PHASES, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        assert isinstance(ev["name"], str) and ev["name"], ev
        if ev["ph"] == "M":
            assert ev["name"] in METADATA and isinstance(ev["args"], dict), ev
            continue
        assert isinstance(ev["ts"], int | float) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], int | float) and ev["dur"] >= 0, ev
        else:
            assert isinstance(ev["id"], str) and ev["cat"] == "request", ev
            key = (ev["cat"], ev["id"])
            open_async[key] += 1 if ev["ph"] == "b" else -1
            assert open_async[key] in (0, 1), ev
    assert all(v == 0 for v in open_async.values()), open_async


class TestTrace:
    def test_every_event_is_valid_trace_format(
        self, records: list[dict[str, Any]], tmp_path: Path
    ) -> None:
        """The written file is {"traceEvents": [...]} with each event well formed."""
        out = tmp_path / "trace.json"
        n = write_trace(records, out)
        data = json.loads(out.read_text())
        assert len(data["traceEvents"]) == n > 0
        _validate(data["traceEvents"])

    def test_each_stage_of_each_step_is_a_slice(self, records: list[dict[str, Any]]) -> None:
        """Every stage record maps to one X event on its rank's pid and stage's tid."""
        events = trace_events(records)
        slices = Counter(
            (e["pid"], e["name"], e["args"]["step_id"]) for e in events if e["ph"] == "X"
        )
        stage_records = [r for r in records if r["event"] == "stage"]
        for r in stage_records:
            pid = ENGINE_PID if r["kind"] == "engine" else r["rank"]
            assert slices[(pid, r["stage"], r["step_id"])] == 1, r
        tids = {(e["pid"], e["name"]): e["tid"] for e in events if e["ph"] == "X"}
        names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
        for (pid, stage), tid in tids.items():
            if not stage.startswith("step "):
                assert names[(pid, tid)] == stage

    def test_processes_are_ranks_and_the_engine(self, records: list[dict[str, Any]]) -> None:
        """pid = rank for workers, ENGINE_PID for the engine, each named."""
        events = trace_events(records)
        names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert names == {0: "rank 0", 1: "rank 1", ENGINE_PID: "engine"}

    def test_requests_span_first_schedule_to_finish(self, records: list[dict[str, Any]]) -> None:
        """Each request is one b/e pair; the longest request ends last."""
        events = trace_events(records)
        begins = {e["id"]: e["ts"] for e in events if e["ph"] == "b"}
        ends = {e["id"]: e["ts"] for e in events if e["ph"] == "e"}
        assert set(begins) == set(ends) and len(begins) == 3
        assert all(ends[i] > begins[i] for i in begins)
        assert max(ends, key=ends.__getitem__) == _LONGEST[0]  # max_tokens=5 (ids are random)

    def test_unfinished_and_reused_ids_stay_balanced(self, records: list[dict[str, Any]]) -> None:
        """A log cut mid-request and a second engine reusing ids still balance b/e."""
        engine_steps = [i for i, r in enumerate(records) if r.get("kind") == "engine"]
        cut = records[: engine_steps[len(engine_steps) // 2]]
        events = trace_events(cut + records)
        _validate(events)
        assert any(e["ph"] == "b" and "#2" in e["id"] for e in events)

    def test_empty_records_give_no_events(self) -> None:
        """Records without timestamps produce an empty trace."""
        assert trace_events([{"event": "step"}]) == []


def test_steps_filter_the_trace(records: list[dict[str, Any]], tmp_path: Path) -> None:
    """`--steps A:B` keeps only those steps' slices in the trace, as in the summary."""
    out = tmp_path / "trace.json"
    everything = write_trace(records, tmp_path / "all.json")
    n = write_trace(records, out, steps=(1, 3))
    events = json.loads(out.read_text())["traceEvents"]
    _validate(events)
    step_ids = {ev["args"].get("step_id") for ev in events if ev["ph"] == "X"}
    assert step_ids == {1, 2}
    assert 0 < n < everything


def test_steps_that_select_nothing_are_refused(
    records: list[dict[str, Any]], tmp_path: Path
) -> None:
    from pipeline.errors import InvalidConfigError

    out = tmp_path / "trace.json"
    with pytest.raises(InvalidConfigError, match="--steps"):
        write_trace(records, out, steps=(10_000, None))
    assert not out.exists()
