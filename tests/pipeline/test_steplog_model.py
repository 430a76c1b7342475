"""The step log's ``model`` record: what the engine runs, with the linear kernel its
projections were put on (issue 27), from the in-process runner or a worker process's
``Ready``; ``kvstep logs`` prints it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.steplog_tools import load_step_log, print_summary
from stages.model import linear_kernels as lk

KERNELS = lk.available_kernels(torch.device("cpu"))


def _model_records(path: Path) -> list[dict[str, object]]:
    return [r for r in load_step_log(path) if r["event"] == "model"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_inprocess_record_names_the_kernel_in_use(
    kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(lk.ENV, kernel)
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model="builtin:tiny", dtype="float32", step_log=str(log))
    with LLM(config) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert llm.engine.core.linear_kernel == kernel
    records = load_step_log(log)
    assert records[0]["event"] == "model"  # before the first step
    (model,) = _model_records(log)
    assert model["linear_kernel"] == kernel and model["compiled"] is False
    assert model["model"] == "builtin:tiny" and model["dtype"] == "float32"
    assert model["executor"] == "inprocess" and model["world_size"] == 1
    assert isinstance(model["num_blocks"], int) and model["num_blocks"] > 0
    out = io.StringIO()
    summary = print_summary(records, file=out)
    assert summary.model["linear_kernel"] == kernel
    assert f"linear_kernel={kernel}" in out.getvalue().splitlines()[0]


@pytest.mark.skipif("onednn" not in KERNELS, reason="no oneDNN in this torch")
def test_a_worker_process_reports_its_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker chose the kernel (the environment reaches it); its Ready carries it."""
    monkeypatch.setenv(lk.ENV, "onednn")
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(
        model="builtin:tiny", dtype="float32", executor="multiproc", step_log=str(log)
    )
    with LLM(config) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert llm.engine.core.linear_kernel == "onednn"
    (model,) = _model_records(log)
    assert model["linear_kernel"] == "onednn" and model["executor"] == "multiproc"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("executor", "world_size", "compiled"),
    [("inprocess", 1, True), ("multiproc", 1, True), ("multiproc", 2, False)],
)
def test_the_record_says_whether_passes_run_compiled(
    tmp_path: Path, executor: str, world_size: int, compiled: bool
) -> None:
    """``torch_compile``: the rank compiled its pass (a worker process's Ready carries
    it), the engine and its model record say so; two tensor-parallel worker processes
    cannot, and they say that too."""
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model="builtin:tiny", dtype="float32", executor=executor,
                          world_size=world_size, torch_compile=True, step_log=str(log))  # fmt: skip
    with LLM(config) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert llm.engine.core.compiled is compiled
    (model,) = _model_records(log)
    assert model["compiled"] is compiled
