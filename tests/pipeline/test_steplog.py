"""The step log: JSON lines per stage and per step, contextvars, no global configuration."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.contextvars import bound_contextvars, get_contextvars

from pipeline.errors import InvalidConfigError
from pipeline.kernel.report import StageRecord, StepReport
from pipeline.steplog import StepLog, bind_step


def make_report(step_id: int = 3, rank: int | None = 0) -> StepReport:
    return StepReport(
        step_id=step_id,
        rank=rank,
        outcome="error",
        duration_s=0.5,
        stages=(
            StageRecord("bind", "ok", 0.0, 0.1, False, None),
            StageRecord("forward", "error", 0.1, 0.2, False, "Boom: x"),
            StageRecord("save", "skipped", 0.0, 0.0, False, None),
            StageRecord("clear", "ok", 0.3, 0.1, True, None),
        ),
        failed_stage="forward",
        finalizer_failures=(),
        start_ts=1_700_000_000.0,
    )


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def unconfigured() -> Iterator[None]:
    """Start from an unconfigured structlog and leave it as it was found."""
    was = structlog.is_configured()
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        yield
    finally:
        if was:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


class TestStepLogFile:
    def test_one_record_per_stage_and_one_per_step(self, tmp_path: Path) -> None:
        """Each stage gets a 'stage' record and the step a 'step' record with the fields."""
        path = tmp_path / "steps.jsonl"
        with StepLog(path) as log:
            log.record_step(make_report(), kind="worker", batch_size=4, num_tokens=17)
        records = read_lines(path)
        assert [r["event"] for r in records] == ["stage"] * 4 + ["step"]
        forward = records[1]
        assert {k: forward[k] for k in ("step_id", "rank", "kind", "stage", "outcome")} == {
            "step_id": 3, "rank": 0, "kind": "worker", "stage": "forward", "outcome": "error"
        }  # fmt: skip
        assert (forward["start_s"], forward["duration_s"], forward["finalizer"]) == (
            0.1,
            0.2,
            False,
        )
        assert forward["error"] == "Boom: x"
        assert forward["start_ts"] == pytest.approx(1_700_000_000.1)
        assert records[3]["finalizer"] is True
        step = records[-1]
        assert (step["outcome"], step["duration_s"], step["failed_stage"]) == (
            "error",
            0.5,
            "forward",
        )
        assert (step["batch_size"], step["num_tokens"], step["kind"]) == (4, 17, "worker")
        assert all(isinstance(r["ts"], float) and r["ts"] > 1e9 for r in records)

    def test_appends_across_logs(self, tmp_path: Path) -> None:
        """A second StepLog on the same path appends; parent folders are created."""
        path = tmp_path / "nested" / "steps.jsonl"
        for step_id in (1, 2):
            with StepLog(path) as log:
                log.record_step(make_report(step_id), kind="engine")
        steps = [r["step_id"] for r in read_lines(path) if r["event"] == "step"]
        assert steps == [1, 2]

    def test_contextvars_reach_the_file(self, tmp_path: Path) -> None:
        """Values bound in structlog contextvars (e.g. a run id) are merged into records."""
        path = tmp_path / "steps.jsonl"
        with StepLog(path) as log, bound_contextvars(run_id="r1"):
            log.record_step(make_report(), kind="worker")
        assert {r["run_id"] for r in read_lines(path)} == {"r1"}

    def test_reserved_field_refused(self, tmp_path: Path) -> None:
        """A field that would overwrite a core key raises InvalidConfigError naming it."""
        with (
            StepLog(tmp_path / "s.jsonl") as log,
            pytest.raises(InvalidConfigError, match="outcome"),
        ):
            log.record_step(make_report(), kind="worker", outcome="ok")

    def test_close_is_idempotent_and_stops_file_writes(self, tmp_path: Path) -> None:
        """close() twice is fine; records after close do not reach the file."""
        path = tmp_path / "s.jsonl"
        log = StepLog(path)
        log.record_step(make_report(), kind="worker")
        log.close()
        log.close()
        assert log.closed
        log.record_step(make_report(), kind="worker")
        assert len(read_lines(path)) == 5

    def test_no_path_writes_nothing(self, tmp_path: Path) -> None:
        """StepLog(None) accepts records without creating files."""
        log = StepLog()
        log.record_step(make_report(), kind="worker")
        log.close()
        assert not log.closed and list(tmp_path.iterdir()) == []

    def test_thread_safe_and_steps_contiguous(self, tmp_path: Path) -> None:
        """Records from several threads are whole lines and each step's records are adjacent."""
        path = tmp_path / "s.jsonl"
        with StepLog(path) as log:

            def work(rank: int) -> None:
                for step_id in range(50):
                    log.record_step(make_report(step_id, rank), kind="worker")

            threads = [threading.Thread(target=work, args=(rank,)) for rank in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        records = read_lines(path)
        assert len(records) == 4 * 50 * 5
        for i in range(0, len(records), 5):
            group = records[i : i + 5]
            assert len({(r["step_id"], r["rank"]) for r in group}) == 1
            assert group[-1]["event"] == "step"


class TestBindStep:
    def test_binds_step_and_rank_for_the_block(self) -> None:
        """bind_step puts step_id and rank in contextvars and removes them after."""
        with bind_step(5, rank=1):
            assert get_contextvars() == {"step_id": 5, "rank": 1}
        assert "step_id" not in get_contextvars()

    def test_without_rank(self) -> None:
        """On the engine side (rank None) only step_id is bound."""
        with bind_step(9):
            assert get_contextvars() == {"step_id": 9}

    def test_restores_outer_binding(self) -> None:
        """A nested bind_step restores the outer step on exit, also on error."""
        with bind_step(1):
            with pytest.raises(ValueError), bind_step(2):
                raise ValueError
            assert get_contextvars()["step_id"] == 1


class TestStructlogConfiguration:
    def test_library_never_configures_structlog(
        self, unconfigured: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Using StepLog leaves structlog unconfigured and prints nothing to stdout."""
        assert not structlog.is_configured()
        with StepLog(tmp_path / "s.jsonl") as log, bind_step(1):
            log.record_step(make_report(), kind="worker", batch_size=1)
        with StepLog() as log:
            log.record_step(make_report(), kind="engine")
        assert not structlog.is_configured()
        assert capsys.readouterr().out == ""

    def test_configured_app_gets_debug_records(self, unconfigured: None) -> None:
        """When the application configured structlog, records also go to the kvstep logger."""
        with structlog.testing.capture_logs() as entries:
            StepLog().record_step(make_report(), kind="worker", batch_size=2)
        assert [e["event"] for e in entries] == ["stage"] * 4 + ["step"]
        assert {e["log_level"] for e in entries} == {"debug"}
        assert entries[-1]["batch_size"] == 2 and entries[1]["stage"] == "forward"
