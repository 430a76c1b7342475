"""Decode steps through :class:`DecodeGraphs`: padded, fixed-buffer, then replayed.

On CPU the graphs are captured by :class:`RecordedReplay`, whose replay runs the
captured tensor ops again and none of the Python, as a CUDA graph's does: what it
computes is checked against the eager path (the tokens, the logits to rounding, the KV
cache), padding rows are checked not to write outside their request's slots, and the
runner and engine plumbing is checked end to end. With CUDA, the same checks run on
real graphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError
from stages.model import cuda_graphs
from stages.model.cuda_graphs import (
    capture_sizes,
    graph_capture,
    padded_width,
)
from stages.model.runner import ModelRunner
from stages.model.settings import RunnerSettings
from tests.pipeline.test_async_scheduling import CASES, _config, _run
from tests.stages.model.graph_replay import RecordedReplay

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def recorded_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runners built from here on capture with :class:`RecordedReplay` (a graph's
    replay semantics on CPU: no Python runs on replay)."""
    monkeypatch.setattr(cuda_graphs, "graph_capture", lambda device: RecordedReplay())


def test_recorded_replay_is_a_graph_replay() -> None:
    """The recorder's replay reads the inputs' current contents but keeps every Python
    value of the capture, and a host sync cannot be captured."""
    x, scale = torch.ones(3), [2.0]
    replay = RecordedReplay().capture(lambda: x * scale[0] + x.sum())
    x.fill_(5.0)
    scale[0] = 10.0  # Python: not seen by the replay
    assert replay().tolist() == [25.0] * 3
    with pytest.raises(RuntimeError, match="syncs with the host"):
        RecordedReplay().capture(lambda: x * x.sum().item())


def test_capture_sizes() -> None:
    """1, 2, 4, then multiples of 8 up to the first that holds ``max_batch``."""
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(4) == (1, 2, 4)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(64)[-3:] == (48, 56, 64)


def test_padded_width() -> None:
    """The next power of two of the blocks needed, capped by the longest context's."""
    assert [padded_width(b, 16) for b in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert padded_width(5, 6) == 6


def _runners(path: Path, device: str, **spec: Any) -> tuple[ModelRunner, ModelRunner]:
    """An eager runner and a graph runner on the same weights, each with its own cache."""
    options: dict[str, Any] = dict(
        device=device, dtype="float32", block_size=4, num_blocks=96, max_model_len=128,
        max_num_seqs=6, **spec,
    )  # fmt: skip
    eager = ModelRunner.load(str(path), **options)
    graphs = ModelRunner.load(str(path), shared_model=eager, cuda_graphs=True, **options)
    return eager, graphs


def _drive_both(path: Path, device: str, step_driver: type) -> tuple[Any, Any]:
    """Prefill and decode 6 requests of different lengths on both runners, in lockstep;
    requests join and finish at different steps, so the batch size changes."""
    eager, graphs = _runners(path, device)
    drivers = [step_driver(r, chunk=8, seed=3) for r in (eager, graphs)]
    prompts = [[(7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(6)]
    for d in drivers:
        for i, p in enumerate(prompts):
            d.add(f"r{i}", p)
    step = 0
    while True:
        lengths = {r: len(drivers[0].outputs(r)) for r in drivers[0].tokens}
        active = [r for r, n in lengths.items() if n < 6 + 3 * int(r[1:])]  # 6..21 tokens
        if not active:
            break
        if step < 3:
            active = active[: 2 + step]  # the others wait: batches of 2, 3, 4, then 6
        for d in drivers:
            d.step(active)
        step += 1
    return drivers[0], drivers[1]


def _check_equal(eager: Any, graphs: Any) -> None:
    assert graphs.runner.decode_graphs.captures > 0
    for req_id in eager.tokens:
        assert graphs.outputs(req_id) == eager.outputs(req_id), req_id
        for a, b in zip(eager.logits[req_id], graphs.logits[req_id], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for a, b in zip(eager.runner.kv_caches, graphs.runner.kv_caches, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["llama_gqa", "gemma3", "phi3_longrope"])
def test_same_tokens_logits_and_cache_as_eager(
    hf_checkpoint: Any, step_driver: type, recorded_replay: None, variant: str
) -> None:
    """Greedy tokens equal, logits and every cache slot equal to rounding, over
    batches of 1 to 6 requests (padded to 1, 2, 4, 8) and contexts of 5 to 13 blocks
    (tables 8 and 16 wide); for Gemma 3 with sliding layers masked per row in the graph;
    for longrope with rows switching to the long factors at position 32 in the graph."""
    _, path = hf_checkpoint(variant)
    eager, graphs = _drive_both(path, "cpu", step_driver)
    _check_equal(eager, graphs)
    shapes = graphs.runner.decode_graphs.shapes
    assert {b for b, _ in shapes} == {1, 2, 4, 8} and {w for _, w in shapes} == {8, 16}


def test_padding_writes_no_other_slot(hf_checkpoint: Any, recorded_replay: None) -> None:
    """A step of 3 requests padded to 4: every slot but the 3 new tokens' keeps its bytes."""
    _, path = hf_checkpoint("llama_gqa")
    _, runner = _runners(path, "cpu")
    graphs = runner.decode_graphs
    assert graphs is not None
    for cache in runner.kv_caches:
        cache.normal_(generator=torch.Generator().manual_seed(0))
    before = [c.clone() for c in runner.kv_caches]
    ctx = [5, 9, 2]
    tables = {"a": (7, 3), "b": (11, 40, 2), "c": (60,)}
    requests = tuple(
        ScheduledRequest(
            req_id=req_id, token_ids=(17,), num_computed_tokens=c, block_ids=tables[req_id],
            new=True, sampling=SamplingParams(temperature=0.0), sample=True,
            num_output_tokens=1,
        )
        for req_id, c in zip("abc", ctx, strict=True)
    )  # fmt: skip
    output = runner.execute(SchedulerOutput(step_id=0, requests=requests))
    assert output.req_ids == ("a", "b", "c") and graphs.shapes == ((4, 4),)
    written = {tables[r][c // 4] * 4 + c % 4 for r, c in zip("abc", ctx, strict=True)}
    for old, new in zip(before, runner.kv_caches, strict=True):
        changed = (old != new).reshape(2, -1, *old.shape[-2:]).any(-1).any(-1).any(0)
        assert set(torch.nonzero(changed).flatten().tolist()) == written


def test_parameter_assignment_recaptures(
    hf_checkpoint: Any, step_driver: type, recorded_replay: None
) -> None:
    """Assigning a parameter drops the captured shapes (they hold the old tensors): the
    next decode step captures again."""
    _, path = hf_checkpoint("llama_gqa")
    _, runner = _runners(path, "cpu")
    driver = step_driver(runner, chunk=8)
    driver.add("a", list(range(1, 10)))  # decode contexts 9 to 12: 3-4 blocks, width 4
    driver.run(3)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.captures == 1 and graphs.shapes == ((1, 4),)
    driver.run(4)
    assert graphs.captures == 1  # the same shape: replayed
    norm = runner.model.model.norm
    norm.weight = nn.Parameter(norm.weight.detach().clone())
    driver.run(5)
    assert graphs.captures == 2 and graphs.shapes == ((1, 4),)


def test_steps_past_the_largest_size_run_eagerly(
    hf_checkpoint: Any, step_driver: type, recorded_replay: None
) -> None:
    """With max_num_seqs 2 (sizes 1, 2), a decode step of 3 requests runs eagerly."""
    _, path = hf_checkpoint("llama_gqa")
    runner = ModelRunner.load(
        str(path), device="cpu", dtype="float32", block_size=4, num_blocks=32,
        max_model_len=64, max_num_seqs=2, cuda_graphs=True,
    )  # fmt: skip
    driver = step_driver(runner, chunk=8)
    for i in range(3):
        driver.add(f"r{i}", [i + 1, 2, 3])
    driver.run(3)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.captures == 0
    assert all(len(driver.outputs(r)) == 3 for r in driver.tokens)


@pytest.mark.parametrize("case", ["plain", "no_prefix_caching"])
def test_engine_outputs_equal(llama_path: Path, recorded_replay: None, case: str) -> None:
    """Through the engine (config -> spec -> runner): the same outputs as without."""
    config = _config(llama_path, **CASES[case])
    assert _run(attrs.evolve(config, cuda_graphs=True)) == _run(config)


def test_config_refusals() -> None:
    """CPU, several ranks, a connector or a non-bool are refused, naming the field."""
    for bad in (
        dict(device="cpu"),
        dict(world_size=2),
        dict(connector="offload", connector_options={"num_blocks": 8}),
    ):
        with pytest.raises(InvalidConfigError, match="cuda_graphs"):
            EngineConfig(cuda_graphs=True, **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="cuda_graphs"):
        RunnerSettings(model="builtin:tiny", cuda_graphs=True, world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_refused_on_a_cpu_model(hf_checkpoint: Any) -> None:
    """Without CUDA, the runner refuses to load with graphs (device auto is the CPU)."""
    _, path = hf_checkpoint("llama_gqa")
    with pytest.raises(InvalidConfigError, match="needs a CUDA device"):
        ModelRunner.load(str(path), device="auto", cuda_graphs=True, num_blocks=8)
    with pytest.raises(InvalidConfigError, match="needs a CUDA device"):
        graph_capture(torch.device("cpu"))


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("variant", ["llama_gqa", "gemma3", "phi3_longrope"])
def test_cuda_graphs_equal_eager(hf_checkpoint: Any, step_driver: type, variant: str) -> None:
    """Real CUDA graphs: the same tokens, logits and cache as the eager path."""
    _, path = hf_checkpoint(variant)
    eager, graphs = _drive_both(path, "cuda", step_driver)
    assert isinstance(graphs.runner.decode_graphs._capture, cuda_graphs.CudaGraphCapture)
    _check_equal(eager, graphs)


@pytest.mark.cuda
@CUDA
def test_cuda_engine_outputs_equal(llama_path: Path) -> None:
    """Through the engine on CUDA, with real graphs: the same outputs as without."""
    config = _config(llama_path, device="cuda")
    assert _run(attrs.evolve(config, cuda_graphs=True)) == _run(config)
