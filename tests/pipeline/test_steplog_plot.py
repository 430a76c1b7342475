"""PNG stage timeline of a step log (pipeline.steplog_tools.plot)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError
from pipeline.steplog_tools.plot import parse_steps, write_plot
from pipeline.steplog_tools.summary import load_step_log


@pytest.fixture
def records(tmp_path: Path) -> list[dict[str, Any]]:
    """Step-log records of a 2-rank engine running 2 requests for 4 tokens."""
    path = tmp_path / "steps.jsonl"
    with LLM(EngineConfig(max_model_len=128, step_log=str(path), world_size=2)) as llm:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0))
    return load_step_log(path)


class TestPlot:
    def test_png_has_sane_size_and_content(
        self, records: list[dict[str, Any]], tmp_path: Path
    ) -> None:
        """The PNG opens, is about 1200 px wide, and is not blank."""
        out = tmp_path / "timeline.png"
        drawn = write_plot(records, out, steps=(1, 3))
        # 2 steps x (engine + 2 ranks) stages and finalizers; the worker graph draws 10 per rank:
        # bind load forward logits structured sample save finished, clear drop_finished
        assert drawn == 2 * (5 + 2 * 10)
        with Image.open(out) as img:
            assert img.format == "PNG"
            width, height = img.size
            pixels = np.asarray(img.convert("L"), dtype=np.float64)
        assert 800 <= width <= 2000 and 150 <= height <= 1000
        assert pixels.std() > 10  # not blank: bars, text and white background

    def test_range_selects_steps(self, records: list[dict[str, Any]], tmp_path: Path) -> None:
        """A wider range draws more records; one outside the log is an error."""
        one = write_plot(records, tmp_path / "a.png", steps=(0, 1))
        every = write_plot(records, tmp_path / "b.png")
        assert one < every
        with pytest.raises(InvalidConfigError, match="selects no stage record"):
            write_plot(records, tmp_path / "c.png", steps=(100, 200))


class TestParseSteps:
    def test_forms(self) -> None:
        """A:B, A:, :B and nothing parse; anything else raises naming the value."""
        assert parse_steps("2:5") == (2, 5)
        assert parse_steps("3:") == (3, None)
        assert parse_steps(":4") == (None, 4)
        assert parse_steps(None) == (None, None)
        for bad in ("5", "a:b", "1:2:3"):
            with pytest.raises(InvalidConfigError, match="--steps"):
                parse_steps(bad)


def _stage(step: int, rank: int | None, stage: str, start: float, dur: float) -> dict[str, Any]:
    kind = "engine" if rank is None else "worker"
    return {"event": "stage", "kind": kind, "stage": stage, "step_id": step, "rank": rank,
            "start_ts": start, "duration_s": dur, "outcome": "ok"}  # fmt: skip


class TestTimelineLayout:
    def test_idle_gap_is_cut_and_marked(self) -> None:
        """A 10 s idle gap between 1 ms steps is cut to one step's width, keeping its length."""
        from pipeline.steplog_tools.plot import TimeAxis

        starts = (100.0, 100.0015, 110.0)
        chosen = [_stage(i, None, "execute", t, 0.001) for i, t in enumerate(starts)]
        axis = TimeAxis.build(chosen)
        (cut,) = axis.cuts()
        assert cut.idle_ms == pytest.approx(9997.5)
        assert axis.x(110.0) == pytest.approx(2.5 + axis.keep_ms)
        assert axis.x(100.0015) == pytest.approx(1.5)  # the short gap stays

    def test_every_stage_has_its_own_colour(self) -> None:
        """Colours are distinct for up to 60 stages (matplotlib's C0..C9 repeat after 10)."""
        from pipeline.steplog_tools.plot import stage_colors

        colors = stage_colors([f"s{i}" for i in range(20)])
        assert len(set(colors.values())) == 20

    def test_plot_of_a_gappy_log_draws_every_bar(self, tmp_path: Path) -> None:
        """A log with an idle gap still renders, one bar per stage record."""
        records = [_stage(s, r, f"st{k}", 10.0 * (s // 2) + 0.001 * s + 0.0001 * k, 0.0001)
                   for s in range(4) for r in (None, 0) for k in range(12)]  # fmt: skip
        assert write_plot(records, tmp_path / "gap.png") == len(records)
