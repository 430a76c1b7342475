"""The helpers of ``benchmarks/disagg.py`` part 3 that decide what is measured: the
pinned layout, the per-process CPU figures, and the reading of a decode engine's step log."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from _disagg_procs import pin_plan
from _disagg_steps import summarize
from _sched_stats import cpu_times, pin

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


@attrs.frozen
class Window:
    start_ts: float
    end_ts: float


class TestPinPlan:
    def test_producer_and_consumer_get_separate_cores(self) -> None:
        """The producer is alone on its core; the decode path shares the other."""
        plan = pin_plan([2, 5, 7])
        assert plan["disaggregated.producer"] == [2]
        for name in ("consumer", "proxy", "client"):
            assert plan[f"disaggregated.{name}"] == [5]

    def test_colocated_gets_the_same_total(self) -> None:
        """The colocated server and its client run on both cores the pair shares."""
        plan = pin_plan([2, 5])
        assert plan["colocated.colocated"] == plan["colocated.client"] == [2, 5]

    def test_one_cpu_is_refused(self) -> None:
        """With one CPU there is nothing to separate: ValueError names the CPUs."""
        with pytest.raises(ValueError, match=r"\[0\]"):
            pin_plan([0])


@linux_only
class TestSchedStats:
    def test_this_process_ran(self) -> None:
        """A live process has run time; a missing one reads as zeros."""
        assert cpu_times(os.getpid()).run_ns > 0
        assert cpu_times(2**22 + 12345).run_ns == 0

    def test_pin_sets_every_thread(self) -> None:
        """Pinning to the CPUs a process already has leaves it runnable everywhere."""
        cpus = os.sched_getaffinity(0)
        pin(os.getpid(), cpus)
        assert os.sched_getaffinity(0) == cpus


def _step(step_id: int, ts: float, dur: float, requests: list[str], **extra: object) -> dict:
    return {
        "event": "step",
        "kind": "engine",
        "step_id": step_id,
        "start_ts": ts,
        "duration_s": dur,
        "requests": requests,
        "batch_size": len(requests),
        "num_tokens": len(requests),
        "loaded_tokens": 0,
        **extra,
    }


class TestSummarize:
    def test_periods_by_kind(self, tmp_path: Path) -> None:
        """Only periods a stream spans count, sorted by what the first step held."""
        streams = ["s1", "s2"]
        records = []
        ts = 100.0
        for i in range(20):  # decode steps of two streams, 10 ms apart
            requests = [*streams, "long"] if i == 5 else streams
            extra = {"loaded_tokens": 1500} if i == 10 else {}
            records.append(_step(i, ts, 0.008, requests, **extra))
            ts += 0.030 if i == 5 else 0.010
        records.append(_step(20, ts + 1.0, 0.001, []))  # idle after the streams ended
        log = tmp_path / "steps.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"half')
        out = summarize(log, [Window(99.0, 200.0)])
        kinds = out["period_ms_by_kind"]
        assert kinds["with_prefill"]["steps"] == 1
        assert kinds["with_prefill"]["max"] == pytest.approx(30.0)
        assert kinds["read_done"]["steps"] == 1
        assert kinds["decode_only"]["steps"] == 17
        assert out["period_ms"]["max"] == pytest.approx(30.0)  # not the idle second
        assert out["gap_ms"]["p50"] == pytest.approx(2.0)

    def test_steps_outside_the_windows_are_left_out(self, tmp_path: Path) -> None:
        """A step that started outside every round's window is not counted."""
        log = tmp_path / "steps.jsonl"
        records = [_step(i, 100.0 + i * 0.01, 0.005, ["s"]) for i in range(30)]
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
        out = summarize(log, [Window(100.0, 100.095)])
        assert out["steps"] == 9
