"""PNG stage timeline of a step log (pipeline.steplogs.logplot)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError
from pipeline.steplogs.logplot import parse_steps, write_plot
from pipeline.steplogs.logview import load_step_log


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
        assert drawn == 2 * (5 + 2 * 8)  # 2 steps x (engine + 2 ranks) stages and finalizers
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
