"""Step-log summary (pipeline.steplog_tools.summary) and the ``kvstep logs`` command."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.cli import main
from pipeline.errors import InvalidConfigError
from pipeline.steplog_tools.summary import load_step_log, print_summary, summarize

WORKER_STAGES = ("bind", "load", "forward", "sample", "save", "finished", "clear")
ENGINE_STAGES = ("schedule", "execute", "fan_in", "update")


@pytest.fixture
def step_log(tmp_path: Path) -> Path:
    """A step log of a 2-rank engine with a recording connector: 3 requests."""
    path = tmp_path / "steps.jsonl"
    config = EngineConfig(max_model_len=128, step_log=str(path), world_size=2,
                          connector="recording")  # fmt: skip
    with LLM(config) as llm:
        llm.generate(
            [[1, 2, 3], [4, 5, 6, 7], [8] * 20], SamplingParams(max_tokens=4, temperature=0)
        )
    return path


class TestSummary:
    def test_summary_counts_steps_stages_and_batches(self, step_log: Path) -> None:
        """Every stage of both graphs is summarized with p50 <= p99 <= max."""
        summary = summarize(load_step_log(step_log))
        names = {(s.kind, s.stage) for s in summary.stages}
        assert {("engine", n) for n in ENGINE_STAGES} <= names
        assert {("worker", n) for n in WORKER_STAGES} <= names
        for s in summary.stages:
            assert 0 <= s.p50_ms <= s.p99_ms <= s.max_ms
        assert summary.ranks == (0, 1)
        assert summary.worker_steps == 2 * summary.engine_steps
        assert summary.batch_size_max == 3
        assert summary.failed_steps == 0
        assert summary.num_tokens == 3 + 4 + 20 + 3 * 3

    def test_printed_tables_name_each_stage(self, step_log: Path) -> None:
        """The printed summary has a row for each stage and the KV traffic line."""
        out = io.StringIO()
        print_summary(load_step_log(step_log), file=out)
        text = out.getvalue()
        for name in WORKER_STAGES + ENGINE_STAGES:
            assert name in text
        assert "KV loaded" in text and "failed steps" in text

    def test_failed_stage_records_are_reported(self, tmp_path: Path) -> None:
        """A failed stage record shows up as an error and a failed step."""
        path = tmp_path / "f.jsonl"
        path.write_text(
            '{"event": "stage", "step_id": 3, "rank": 0, "kind": "worker", "stage": "load",'
            ' "outcome": "error", "duration_s": 0.001, "error": "OSError: boom",'
            ' "start_ts": 10.0}\n'
            '{"event": "step", "step_id": 3, "rank": 0, "kind": "worker", "outcome": "error",'
            ' "duration_s": 0.002, "start_ts": 10.0}\n'
        )
        summary = summarize(load_step_log(path))
        assert summary.failed_steps == 1
        assert summary.stage_errors == ((3, 0, "load", "OSError: boom"),)
        assert summary.stages[0].errors == 1


class TestLoad:
    def test_half_written_last_line_is_skipped(self, step_log: Path) -> None:
        """A truncated final line (a log being written) does not fail the read."""
        full = load_step_log(step_log)
        step_log.write_text(step_log.read_text() + '{"event": "sta')
        assert load_step_log(step_log) == full

    def test_corrupt_middle_line_names_the_line(self, step_log: Path) -> None:
        """Garbage inside the log is an error naming file and line."""
        lines = step_log.read_text().splitlines()
        lines[1] = "\x00not json"
        step_log.write_text("\n".join(lines) + "\n")
        with pytest.raises(InvalidConfigError, match=r"steps\.jsonl:2"):
            load_step_log(step_log)

    def test_missing_or_empty_file_is_an_error(self, tmp_path: Path) -> None:
        """No file, or no record, raises InvalidConfigError naming the path."""
        with pytest.raises(InvalidConfigError, match="nope"):
            load_step_log(tmp_path / "nope.jsonl")
        (tmp_path / "empty.jsonl").write_text("\n")
        with pytest.raises(InvalidConfigError, match="no step record"):
            load_step_log(tmp_path / "empty.jsonl")


class TestLogsCommand:
    def test_logs_prints_summary_and_writes_both_outputs(
        self, step_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """kvstep logs FILE --trace --plot prints the tables and writes both files."""
        trace, plot = tmp_path / "t.json", tmp_path / "p.png"
        argv = ["logs", str(step_log), "--trace", str(trace), "--plot", str(plot), "--steps", "0:2"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "forward" in out and "stage latency" in out
        assert trace.stat().st_size > 0 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_bad_file_or_range_exits_2(
        self, step_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A missing log or a malformed / empty --steps range is a clean error."""
        assert main(["logs", str(tmp_path / "missing.jsonl")]) == 2
        plot = str(tmp_path / "p.png")
        assert main(["logs", str(step_log), "--plot", plot, "--steps", "x"]) == 2
        assert main(["logs", str(step_log), "--plot", plot, "--steps", "900:"]) == 2
        assert capsys.readouterr().err.count("kvstep: error") == 3


class TestCountsAndRange:
    def test_counts_line_names_steps_records_and_ranks(self, step_log: Path) -> None:
        """The summary opens with engine steps, worker step records and the number of ranks."""
        out = io.StringIO()
        summary = print_summary(load_step_log(step_log), file=out)
        line = (
            f"engine steps: {summary.engine_steps}, "
            f"worker step records: {2 * summary.engine_steps} over 2 ranks"
        )
        assert line in out.getvalue()

    def test_steps_range_filters_the_summary(
        self, step_log: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``kvstep logs --steps 1:3`` summarizes 2 engine steps, not the whole log."""
        records = load_step_log(step_log)
        assert summarize(records, (1, 3)).engine_steps == 2
        assert main(["logs", str(step_log), "--steps", "1:3"]) == 0
        assert "engine steps: 2, worker step records: 4 over 2 ranks (steps 1:3)" in (
            capsys.readouterr().out
        )
