"""Worker processes: what ``executor="multiproc"`` costs per step, and what TP=2 buys.

**1. Per-step fan-in overhead.** Median µs of one engine step (``EngineCore.step()``
timed with ``perf_counter_ns`` around the await, step log off, so the number is the
whole ``schedule → execute → fan_in → update`` graph plus the engine's bookkeeping) of
``multiproc`` with 2 worker processes against ``inprocess`` with 1 and 2 virtual ranks,
on ``builtin:tiny``, with a batch of ``--batch`` requests in decode (one token each per
step), two ways:

* **no-op**: every rank's worker graph keeps its shape
  ``bind → load → forward → {sample | save} → finished ⟂ clear`` but ``bind``, ``load``,
  ``forward``, ``sample`` and ``save`` are no-op stages producing the same artifacts
  (the driver's ``sample`` returns a fixed token per request, so requests keep
  decoding); ``finished`` and ``clear`` are the real ones (no connector: nothing to
  ask). No model runs: the number is executor + transport (msgspec over a socket
  pair) + fan-in. The worker graph is given as the import path
  ``"_worker_steps:noop_worker_graph"`` (``_worker_steps.py``; worker processes get the
  engine's ``sys.path``).
* **model**: the default worker graph, the real tiny model (each multiproc rank holds
  half of it, tensor-parallel over gloo; each in-process rank the whole model).

All six engines (3 executors, 2 worker graphs) are started at once, so the worker
processes' starts overlap; the three engines of one worker graph are then stepped in
``--rounds`` alternating rounds (so they share any drift) while the other three idle.
The prefill step and ``--warmup`` decode steps of each engine are not timed. Ratios are
multiproc/inprocess.

**2. Throughput.** Generated tokens/s of ``LLM.generate`` on the ~30M-parameter random
Llama of ``benchmarks/throughput.py`` (float32, greedy, ``--prompts`` prompts of
``--prompt-len`` tokens, ``--new-tokens`` new tokens each) with TP=1 (``inprocess``, 1
rank), TP=1 in a worker process (``multiproc``, 1 rank: the price of being in another
process) and TP=2 (``multiproc``, 2 ranks). The model runs in a fresh process in each
case: the in-process engine in a child process of its own (as in ``throughput.py``),
the multiproc engines from this process (their engine side runs no torch) in new worker
processes; the two multiproc engines are started together and measured one after the
other. Each generates once untimed and then ``--repeats`` times (the best run counts).
Worker processes set torch's threads to ``cores // world_size``; the in-process engine
uses torch's default. Greedy outputs are compared with TP=1 in-process, request by
request ("same as TP1"), and across all three.

On a machine shared with other work the numbers are only indicative: in-process torch
on all cores is the most sensitive to other load.

    python benchmarks/workers.py [--steps 300] [--batch 8] [--prompts 16]
        [--prompt-len 128] [--new-tokens 32] [--json PATH]

JSON goes to ``benchmarks/results/workers.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from _results import RESULTS, save
from _worker_steps import STEP_VARIANTS, measure_all_steps
from _worker_tp import cores, measure_tp, run_inprocess
from _worker_transport import measure_all_reduce, measure_round_trip


def print_table(title: str, headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{h:>14}" for h in headers))
        for row in rows:
            print("  ".join(f"{c:>14}" for c in row))
    else:
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=120).print(table)


def print_results(result: dict[str, Any]) -> None:
    steps = result["steps"]
    rows = []
    for kind in ("noop", "model"):
        part = steps[kind]
        med = part["median_us"]
        rows.append(
            (
                kind,
                *(f"{med[label]:.0f}" for label, _, _ in STEP_VARIANTS),
                f"{part['ratio_multiproc2_vs_inprocess1']:.2f}x",
                f"{part['ratio_multiproc2_vs_inprocess2']:.2f}x",
                f"{part['multiproc2_added_us_vs_inprocess2']:.0f}",
            )
        )
    print_table(
        f"µs per engine step (median of {result['config']['steps']} decode steps, batch "
        f"{result['config']['batch']}, builtin:tiny)",
        (
            "worker graph",
            *(f"{label} µs" for label, _, _ in STEP_VARIANTS),
            "mp2/ip1",
            "mp2/ip2",
            "mp2-ip2 µs",
        ),
        rows,
    )
    print(
        f"bare round trip engine -> echo process -> engine (msgspec over a socket pair): "
        f"{steps['round_trip_us']:.0f} µs median"
    )
    tp = result["tp"]
    print_table(
        f"Throughput ({tp['model_parameters'] / 1e6:.0f}M Llama, {tp['prompts']} prompts"
        f" x {tp['prompt_len']} tokens, {tp['new_tokens']} new tokens, float32, greedy)",
        ("engine", "threads/rank", "seconds", "tokens/s", "same as TP1"),
        [
            (
                label,
                str(r["threads_per_rank"]),
                f"{r['seconds']:.2f}",
                f"{r['tok_s']:.1f}",
                f"{r['match_vs_tp1_inprocess']:.0%}",
            )
            for label, r in tp["runs"].items()
        ],
    )
    ar = tp["all_reduce_us"]
    print(
        f"all-reduce between 2 processes, float32 [{tp['batch_rows']}, {tp['hidden_size']}] "
        f"(one decode step's reduction; a step makes {tp['reductions_per_step']}): "
        f"gloo {ar['gloo']:.0f} µs, shared memory {ar['shared_memory']:.0f} µs (median)"
    )
    print(
        f"TP2/TP1 tokens/s: {tp['ratio_tp2_vs_tp1_inprocess']:.2f}x vs in-process, "
        f"{tp['ratio_tp2_vs_tp1_multiproc']:.2f}x vs one worker process; "
        f"TP1 multiproc/inprocess: {tp['ratio_tp1_multiproc_vs_inprocess']:.2f}x; "
        f"identical greedy outputs in all three: {tp['identical_outputs_all_three']:.0%}"
    )


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "anyio": importlib.metadata.version("anyio"),
        "msgspec": importlib.metadata.version("msgspec"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cores": cores(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per engine")
    parser.add_argument("--warmup", type=int, default=20, help="untimed decode steps first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (part 1)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding (part 1)")
    parser.add_argument("--step-prompt-len", type=int, default=16, help="their prompt length")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument("--json", type=Path, default=RESULTS / "workers.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "rounds", "step_prompt_len", "prompts", "prompt_len",
                 "new_tokens", "repeats"):  # fmt: skip
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.rounds > args.steps:
        parser.error("--warmup must be >= 0 and --rounds <= --steps")

    if args.child:  # the in-process engine's own process (see measure_tp)
        run = run_inprocess(args.model_path, args)
        args.json.write_text(json.dumps(run))
        return run

    wall = time.perf_counter()
    steps = anyio.run(measure_all_steps, args)
    steps["round_trip_us"] = anyio.run(measure_round_trip, args.steps)
    steps_s = time.perf_counter() - wall
    tp = measure_tp(args)
    tp["all_reduce_us"] = measure_all_reduce(tp["batch_rows"], tp["hidden_size"])
    result = {
        "benchmark": "workers",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "child", "model_path")},
        "timing": "EngineCore.step() wall time (perf_counter_ns), step log off",
        "steps": steps,
        "tp": tp,
        "environment": environment(),
        "wall_s": round(time.perf_counter() - wall, 1),
        "part1_s": round(steps_s, 1),
    }
    print_results(result)
    print(f"wall time: {result['wall_s']:.1f} s")
    save(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
