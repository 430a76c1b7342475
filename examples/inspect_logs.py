"""Write a step log, then read it back: summary tables, a Perfetto trace, a PNG timeline.

The same as ``kvstep logs steps.jsonl --trace trace.json --plot timeline.png --steps 0:4``.
Open ``trace.json`` in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.steplog_tools.summary import load_step_log, print_summary, write_plot, write_trace


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        config = EngineConfig(model="builtin:tiny", max_model_len=256, world_size=2, step_log=log)
        with LLM(config) as llm:
            llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0))
        records = load_step_log(log)
        summary = print_summary(records)
        events = write_trace(records, Path(tmp) / "trace.json")
        drawn = write_plot(records, Path(tmp) / "timeline.png", steps=(0, 4))
    print(f"{len(records)} records, {events} trace events, {drawn} stages plotted")
    return summary.engine_steps


if __name__ == "__main__":
    main()
