"""Every benchmark script runs end to end at a tiny size (numbers are not checked here:
benchmarks measure, tests only keep the scripts working as the code under them moves)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
TINY_ARGS = {
    "step_overhead.py": ["--steps", "50", "--decode-tokens", "20", "--decode-rounds", "1"],
    "crash_consistency.py": ["--trials", "3"],
    # without CUDA it measures nothing and says so (its CHECKS entry holds it to that)
    "cuda_graphs.py": [
        "--batches",
        "1",
        "2",
        "--tokens",
        "4",
        "--rounds",
        "1",
        "--layers",
        "1",
        "--hidden",
        "64",
    ],
    "detokenize.py": ["--lengths", "50", "--repeats", "1"],
    "sampling.py": ["--vocabs", "2000", "--batches", "2", "--repeats", "2"],
    # part 3 (four server processes) is left out: it alone takes ~25 s on an idle box
    "disagg.py": [
        "--parts",
        "1,2",
        "--model",
        "small",
        "--transfer-prompt-len",
        "64",
        "--transfer-repeats",
        "1",
        "--prompt-lens",
        "64",
        "--prompts",
        "1",
    ],
    "layer_overlap.py": ["--prefix-len", "64", "--new-len", "8", "--repeats", "1"],
    "kv_reuse.py": ["--prompts", "1", "--prompt-len", "64"],
    # one policy and two replicas (each policy starts fresh processes): ~12 s
    "routing.py": [
        "--policies",
        "kv-aware",
        "--replicas",
        "2",
        "--num-requests",
        "4",
        "--request-rate",
        "20",
        "--num-prefixes",
        "2",
        "--prefix-words",
        "20,40",
        "--suffix-words",
        "2,4",
        "--output-tokens",
        "2,2",
        "--warmup",
        "1",
        "--pressure-requests",
        "4",
        "--pressure-clients",
        "2",
        "--pressure-prefixes",
        "2",
        "--pressure-prefix-tokens",
        "48",
        "--pressure-gpu-blocks",
        "16",
        "--trace",
    ],
    "roofline.py": [
        "--prefill-tokens",
        "32",
        "--prefill-seq-len",
        "16",
        "--decode-tokens",
        "2",
        "--gemm-size",
        "256",
        "--bandwidth-mib",
        "16",
        "--repeats",
        "1",
    ],
    "serve.py": [
        "--num-requests",
        "6",
        "--request-rate",
        "20",
        "--warmup",
        "1",
        "--prefix-words",
        "8,16",
        "--suffix-words",
        "2,8",
        "--output-tokens",
        "4,8",
    ],
    "structured.py": ["--concurrency", "2", "--rounds", "1", "--schemas", "4"],
    "spec_decode.py": [
        "--model",
        "builtin:tiny",
        "--vocab",
        "256",
        "--batches",
        "1",
        "2",
        "--new-tokens",
        "24",
        "--rounds",
        "1",
    ],
    "decode_mirror.py": [
        "--dtypes",
        "float32",
        "--batches",
        "2",
        "--rounds",
        "2",
        "--steps",
        "1",
    ],
    "lora.py": [
        "--model",
        "builtin:tiny",
        "--vocab",
        "256",
        "--batch",
        "3",
        "--adapters",
        "2",
        "--rank",
        "4",
        "--prompt-len",
        "16",
        "--new-tokens",
        "4",
        "--rounds",
        "1",
    ],
    "moe.py": [
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "2",
        "--repeats",
        "1",
        "--experts",
        "4",
    ],
    "throughput.py": [
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "2",
        "--repeats",
        "1",
    ],
    # vLLM is not installed here: each says so, writes {"skipped": true} and exits 0.
    "vs_vllm.py": ["--vllm-python", sys.executable],
    "vs_vllm_serve.py": ["--vllm-python", sys.executable],
    "workers.py": [
        "--steps",
        "20",
        "--warmup",
        "3",
        "--rounds",
        "2",
        "--batch",
        "2",
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
    ],
}


def _check_serve(result: dict) -> None:
    """Every request completed, and each metric has both sides' p50/p99 compared."""
    assert result["completed"] == result["num_requests"] == 6
    assert result["output_tokens_total"] == result["output_tokens_expected"]
    assert sum(result["server_finished"].values()) == 6
    assert [m["metric"] for m in result["metrics"]] == ["TTFT", "TPOT", "ITL", "E2E"]
    for metric in result["metrics"]:
        for tag in ("p50", "p99"):
            assert metric[f"client_{tag}_s"] > 0
            assert metric[f"server_{tag}_s"] > 0
            assert isinstance(metric[f"{tag}_rel_diff"], float)
            assert isinstance(metric[f"{tag}_ok"], bool)
    assert isinstance(result["all_ok"], bool)


def _check_routing(result: dict) -> None:
    """Both scenarios ran; every request completed through the proxy, the replicas
    counted them, and the trace saw each decision."""
    assert [s["scenario"] for s in result["scenarios"]] == ["poisson", "memory-pressure"]
    for scenario in result["scenarios"]:
        (row,) = scenario["policies"]
        assert row["policy"] == "kv-aware"
        assert (row["completed"], row["failed"]) == (4, 0)
        assert sum(row["requests_per_replica"]) == 4
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert row["route_decisions"] >= 4
        assert row["trace"]["decisions"] == 4


def _check_cuda_graphs(result: dict) -> None:
    """Without CUDA, nothing is measured and the JSON says why; with it, both engines
    ran every batch size."""
    if not torch.cuda.is_available():
        assert result["skipped"].startswith("needs a CUDA device")
        assert "results" not in result
        return
    assert [r["batch"] for r in result["results"]] == [1, 2]
    for r in result["results"]:
        assert r["eager_ms_per_step"] > 0 and r["graphs_ms_per_step"] > 0


def _check_step_overhead(result: dict) -> None:
    """The decode step has every contender timed against the bare forward, and where
    each engine's step went (the handed-over engine's stages too)."""
    decode = result["decode_step"]
    assert decode["bare_ms"] > 0
    for contender in ("kvstep", "kvstep_sync", "kvstep_handed", "kvstep_inline", "generate"):
        assert decode[f"{contender}_ms"] > 0 and decode[f"ratio_{contender}_bare"] > 0
    for stages in ("stages_us", "stages_in_series_us", "stages_handed_us", "stages_inline_us"):
        assert decode[stages]["worker.forward"] > 0


def _check_structured(result: dict) -> None:
    """Each backend's row (llguidance, and xgrammar unless it is not installed) has
    both latencies, their ratio and compile quantiles."""
    rows = {row["backend"]: row for row in result["results"]}
    assert set(rows) == {"llguidance", "xgrammar"}
    for row in rows.values():
        if "skipped" in row:
            assert row["backend"] == "xgrammar" and "not installed" in row["skipped"]
            continue
        assert row["constrained_ms_per_token"] > 0 and row["unconstrained_ms_per_token"] > 0
        assert row["ratio"] > 0
        assert 0 < row["compile"]["cold_p50_ms"] <= row["compile"]["cold_p99_ms"]
        assert 0 < row["compile"]["cached_p50_ms"] <= row["compile"]["cached_p99_ms"]


def _check_spec_decode(result: dict) -> None:
    """Every workload at each batch size, identical greedy (and seeded) tokens, drafts
    counted."""
    rows = result["results"]
    assert {(r["workload"], r["batch"]) for r in rows} == {
        (w, b) for w in ("copy-edit", "random", "sampled") for b in (1, 2)
    }
    for row in rows:
        assert row["identical"] is True and row["ratio"] > 0
        assert 0 <= row["kept"] <= row["drafts"]


def _check_lora(result: dict) -> None:
    """Every workload measured; base rows' tokens the same with LoRA on."""
    names = [row["workload"] for row in result["results"]]
    assert names == ["base", "base, LoRA on", "one adapter", "mixed"]
    assert all(row["tokens_per_s"] > 0 for row in result["results"])
    assert result["base_tokens_unchanged"] is True


def _check_vs_vllm(result: dict) -> None:
    """Without vLLM the comparison is skipped, and says so (no made-up figures)."""
    if importlib.util.find_spec("vllm") is None:
        assert result["skipped"] is True and "runs" not in result


CHECKS = {
    "vs_vllm.py": _check_vs_vllm,
    "vs_vllm_serve.py": _check_vs_vllm,
    "structured.py": _check_structured,
    "spec_decode.py": _check_spec_decode,
    "lora.py": _check_lora,
    "step_overhead.py": _check_step_overhead,
    "serve.py": _check_serve,
    "routing.py": _check_routing,
    "cuda_graphs.py": _check_cuda_graphs,
}

# throughput.py's serving mode: both scenarios, four requests, two per batch.
SERVING_ARGS = [
    "--serving",
    "--num-requests",
    "4",
    "--request-rate",
    "50",
    "--batch",
    "2",
    "--num-prefixes",
    "2",
    "--prefix-words",
    "4,8",
    "--suffix-words",
    "1,8",
    "--output-tokens",
    "2,4",
    "--warmup",
    "1",
    "--check-requests",
    "2",
    "--inline-forward",
    "--hand-over",
]


def test_every_benchmark_is_covered() -> None:
    """Each script in benchmarks/ has a tiny-size invocation here (``_*`` are helpers)."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(TINY_ARGS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", sorted(TINY_ARGS))
def test_benchmark_runs_and_writes_json(script: str, tmp_path: Path) -> None:
    """The script exits 0, prints its table and writes a JSON object (checked further
    where CHECKS has a check for it)."""
    result = _run(script, TINY_ARGS[script], tmp_path / "result.json")
    if script in CHECKS:
        CHECKS[script](result)


@pytest.mark.timeout(180)
def test_throughput_serving_mode_runs(tmp_path: Path) -> None:
    """``throughput.py --serving`` serves every request on both engines (and kvstep with
    every forward pass inline, and with every one handed over, which give the same greedy
    tokens) in both scenarios and reports throughput, TTFT/ITL quantiles and the
    saturation ratio."""
    result = _run("throughput.py", SERVING_ARGS, tmp_path / "result.json")
    assert [run["scenario"] for run in result["runs"]] == ["poisson", "saturation"]
    for run in result["runs"]:
        assert run["kvstep-inline_identical"] == run["kvstep-handed_identical"] == 1.0
        for engine in ("kvstep", "transformers", "kvstep-inline", "kvstep-handed"):
            row = run[engine]
            assert 4 * 2 <= row["output_tokens"] <= 4 * 4
            assert row["output_tok_s"] > 0
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
            assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
    assert result["saturation_ratio"] == result["runs"][1]["ratio"] > 0


def _run(script: str, args: list[str], out: Path) -> dict:
    """Run ``script`` with ``args``; it exits 0, prints, and writes a JSON object to ``out``."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip()
    result = json.loads(out.read_text())
    assert isinstance(result, dict) and result
    return result
