"""``throughput.py --serving``: kvstep's ``AsyncEngine`` (continuous batching) against a
transformers static-batch server loop, both in-process (no HTTP: engines, not servers),
under one seeded workload of Poisson arrivals, mixed lengths and shared prefixes.

The workload is ``benchmarks/serve.py``'s (:func:`_serve_client.build_workload`): each
prompt is one of ``--num-prefixes`` shared prefixes (``--prefix-words``) plus a unique
suffix (``--suffix-words``); each word becomes one token id (crc32 of the word, so the
same prefix is the same tokens; the random Llama has no tokenizer), so prompts are
``prefix + suffix`` tokens long. Each request asks for ``max_tokens`` from
``--output-tokens`` with EOS not special. Two scenarios share the requests and differ
in arrival times: ``poisson`` (``--request-rate`` requests/s) and ``saturation`` (all at
t=0, where throughput is the server's capacity). Each (engine, scenario) runs in a fresh
process (see ``throughput.py``), after a few untimed warm-up requests of other prefixes,
greedy, same dtype, ``--threads`` torch threads on both sides.

* **kvstep**: ``AsyncEngine`` with ``max_num_seqs = --batch``; each request is submitted
  at its arrival time and its stream consumed; prefix caching as configured (on by
  default: the shared prefixes are the point; ``--no-prefix-caching`` turns it off).
* **baseline**: a loop that, whenever it is idle, takes up to ``--batch`` requests that
  have arrived (first come, first served), left-pads them and runs ``model.generate()``
  for the batch to its longest ``max_tokens``, then the next batch; tokens past a
  request's own length, and pad positions, are computed and wasted, as static batching
  does. A ``BaseStreamer`` stamps each decoding step as ``generate`` hands its tokens
  over (synchronously on CPU), so a request's token times are exact, not a
  ``(generate time - prefill) / tokens`` estimate: its first token is its batch's
  first step (prefill included), and its tokens past its ``max_tokens`` do not count.

Per request, TTFT is arrival -> first token and ITL every gap between two outputs
carrying tokens (one per token: both sides emit one token per step); quantiles as in
``serve.py`` (type 4). Throughput is output tokens / (last request's last token - t=0);
the baseline's wasted tail steps after its last useful token are not charged to it.

Greedy agreement: the baseline also runs the first ``--check-requests`` prompts alone
(batch 1, no padding) as the reference. Left padding leaves the baseline's math the same
in exact arithmetic (pads are masked, positions count from each row's first real token)
but not in floating point (other matmul shapes, softmax over masked columns), so a
near-tied argmax could flip; in the recorded runs every request agreed on all three sides.

Recorded (2-CPU box, fp32, 2 threads, the defaults: 64 requests, prompts 83..490 tokens,
16..64 output tokens, batch 16): at saturation kvstep 131.6 tok/s vs 64.0 (2.06x; 1.89x
with ``--no-prefix-caching``: the padding the baseline computes, 40% of its prefill and
42% of its decode rows, is most of the gap). At 1 request/s, under both capacities, both
serve the offered load (the tok/s are equal) and kvstep's TTFT p50/p99 is 135/340 ms
against 392/2128 ms; its ITL p99 is higher (121 vs 39 ms): a decode step that carries
another request's prefill chunk is a long gap, which a static batch never has. The
default rate is 1.0 for that reason: at 1.5 the baseline, forming small batches as
requests trickle in, falls behind (0.57 req/s done) and its TTFT p99 reaches 55 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _throughput_serving_report as report
import anyio
import attrs
import torch
from _results import save
from _serve_client import build_workload
from _throughput_baseline import baseline
from serve import _range

from pipeline import AsyncEngine, EngineConfig, SamplingParams

SCENARIOS = ("poisson", "saturation")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving mode's flags (``--json``, ``--dtypes``, ``--engine`` are shared)."""
    group = parser.add_argument_group("serving mode (--serving)")
    group.add_argument("--serving", action="store_true", help="run the serving comparison")
    group.add_argument("--num-requests", type=int, default=64)
    group.add_argument("--request-rate", type=float, default=1.0, help="requests/s (Poisson)")
    group.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--num-prefixes", type=int, default=4, help="shared prompt prefixes")
    group.add_argument("--prefix-words", type=_range, default=(32, 128), help="LOW,HIGH")
    group.add_argument("--suffix-words", type=_range, default=(1, 384), help="LOW,HIGH")
    group.add_argument("--output-tokens", type=_range, default=(16, 64), help="LOW,HIGH")
    group.add_argument("--batch", type=int, default=16, help="most requests in a batch")
    group.add_argument("--threads", type=int, default=torch.get_num_threads())
    group.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    group.add_argument("--check-requests", type=int, default=4, help="unpadded references")
    group.add_argument("--no-prefix-caching", action="store_true", help="kvstep's cache off")
    for flag, what in (
        ("--async-scheduling", "async scheduling"),
        ("--inline-forward", "the forward pass on its event loop's thread"),
        ("--hand-over", "every forward pass handed to the compute thread"),
    ):
        group.add_argument(
            flag, action="store_true",
            help=f"also run kvstep with {what} (reported beside it, in its own process)",
        )  # fmt: skip
    group.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)


@attrs.frozen
class Job:
    """One request: ``arrival_s`` after the start, its prompt ids and output length."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int


def workload(
    args: argparse.Namespace, vocab: int, scenario: str, warmup: bool = False
) -> list[Job]:
    """The seeded requests (``warmup``: ``--warmup`` others, all at t=0)."""
    count, seed = (args.warmup, args.seed + 1) if warmup else (args.num_requests, args.seed)
    at_zero = warmup or scenario == "saturation"
    return [
        Job(0.0 if at_zero else s.send_at_s, _ids(s.prompt, vocab), s.max_tokens)
        for s in build_workload(args, count, seed)
    ]


def _ids(text: str, vocab: int) -> list[int]:
    return [1 + zlib.crc32(word.encode()) % (vocab - 1) for word in text.split()]


# -- the two engines (each in a child process) ---------------------------------------------


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "async_scheduling": ("kvstep-async", {"async_scheduling": True}),
    "inline_forward": ("kvstep-inline", {"inline_forward": True}),
    "hand_over": ("kvstep-handed", {"inline_forward_below_s": 0.0}),
}
"""Flag (``args`` attribute) -> (engine name, ``EngineConfig`` overrides) of kvstep's
variants, each compared with kvstep's defaults on the same workload."""


async def _kvstep(
    args: argparse.Namespace, path: Path, jobs: list[Job], warm: list[Job], overrides: Any
) -> Any:
    longest = max(len(j.prompt) + j.max_tokens for j in jobs + warm)
    config = EngineConfig(
        model=str(path),
        dtype=args.dtypes[0],
        max_num_seqs=args.batch,
        max_model_len=longest + 16,
        enable_prefix_caching=not args.no_prefix_caching,
        **overrides,
    )
    async with AsyncEngine(config) as engine:
        await _drive(engine, warm)
        return {"requests": await _drive(engine, jobs)}


async def _drive(engine: AsyncEngine, jobs: list[Job]) -> list[dict[str, Any]]:
    """Submit each job at its time; record its token times (from the start) and ids."""
    records: list[dict[str, Any]] = [{"times": [], "tokens": [], "cached": 0} for _ in jobs]

    async def consume(stream: Any, record: dict[str, Any]) -> None:
        async for out in stream:
            if out.new_token_ids:
                record["times"].append(time.perf_counter() - start)
                record["tokens"] += out.new_token_ids
            record["cached"] = max(out.num_cached_tokens, 0)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for job, record in zip(jobs, records, strict=True):
            delay = start + job.arrival_s - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
            tg.start_soon(consume, engine.generate(job.prompt, params), record)
    return records


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.engine`` on ``args.scenario``; write the records to ``args.json``."""
    torch.set_num_threads(args.threads)
    path = args.model_path
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    jobs = workload(args, vocab, args.scenario)
    warm = workload(args, vocab, args.scenario, warmup=True)
    variants = {name: overrides for name, overrides in VARIANTS.values()}
    if args.engine == "kvstep" or args.engine in variants:
        overrides = variants.get(args.engine, {})
        result = anyio.run(_kvstep, args, path, jobs, warm, overrides)
    else:
        result = baseline(args, path, jobs, warm)
    args.json.write_text(json.dumps(result))
    return {"requests": len(jobs)}


# -- the parent: run the children, report ---------------------------------------------------


def _child_run(script: str, argv: Sequence[str], engine: str, scenario: str, path: Path) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        flags = ["--engine", engine, "--scenario", scenario, "--model-path", str(path)]
        subprocess.run([sys.executable, script, *argv, *flags, "--json", str(out)], check=True)
        return json.loads(out.read_text())


def compare(
    args: argparse.Namespace, argv: Sequence[str], script: str, build: Callable[[Path], int]
) -> dict[str, Any]:
    """Build the model, run every (scenario, engine) in its own process, report."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        params = build(path)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        for scenario in args.scenarios:
            jobs = workload(args, vocab, scenario)
            hf = _child_run(script, argv, "transformers", scenario, path)
            kv = _child_run(script, argv, "kvstep", scenario, path)
            kv_tokens = [r["tokens"] for r in kv["requests"]]
            hf_tokens = [r["tokens"] for r in hf["requests"]]
            run = {
                "scenario": scenario,
                "kvstep": report.summarize(jobs, kv["requests"]),
                "transformers": report.summarize(jobs, hf["requests"]),
                "kvstep_cached_prompt_tokens": sum(r["cached"] for r in kv["requests"]),
                **report.waste(jobs, hf["requests"]),
                "identical_kvstep_vs_transformers": report.same(kv_tokens, hf_tokens),
                "identical_kvstep_vs_reference": report.same(kv_tokens, hf["reference"]),
                "identical_transformers_vs_reference": report.same(hf_tokens, hf["reference"]),
            }
            run["ratio"] = run["kvstep"]["output_tok_s"] / run["transformers"]["output_tok_s"]
            for flag, (engine, _) in VARIANTS.items():
                if getattr(args, flag):
                    variant = _child_run(script, argv, engine, scenario, path)
                    run[engine] = report.summarize(jobs, variant["requests"])
                    tokens = [r["tokens"] for r in variant["requests"]]
                    run[f"{engine}_identical"] = report.same(tokens, kv_tokens)
            runs.append(run)
    prompt_tokens = [len(j.prompt) for j in jobs]
    result = {
        "mode": "serving",
        "model_parameters": params,
        "dtype": args.dtypes[0],
        "threads": args.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_requests": args.num_requests,
        "request_rate": args.request_rate,
        "seed": args.seed,
        "batch": args.batch,
        "num_prefixes": args.num_prefixes,
        "prompt_tokens": [min(prompt_tokens), max(prompt_tokens), sum(prompt_tokens)],
        "output_tokens": list(args.output_tokens),
        "prefix_caching": not args.no_prefix_caching,
        "runs": runs,
    }
    saturation = [r for r in runs if r["scenario"] == "saturation"]
    if saturation:
        result["saturation_ratio"] = saturation[0]["ratio"]
        result["meets_target"] = saturation[0]["ratio"] >= report.TARGET_RATIO
    report.print_table(result)
    save(args.json, result)
    return result
