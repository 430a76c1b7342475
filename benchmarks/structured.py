"""Structured outputs: what a grammar costs a request, and what a compile costs (issue 26).

Two measurements, on the embedded default model (``builtin:tiny``: random weights, vocab
512, so the forward pass is small and the mask's share of a step is as large as it gets):

* **Per-output-token latency.** ``--concurrency`` requests at once through one
  ``AsyncEngine``, all ``json_schema``-constrained (the schema below, temperature 1.0,
  seeded) against the same number unconstrained (``ignore_eos``, ``max_tokens`` equal to
  the constrained outputs' median length). A request's per-token latency is (last
  output - first output) / (tokens - 1); the table gives the median over requests and
  its ratio, constrained / unconstrained. Rounds alternate the two so they share any
  drift of the machine. Goal: <= 1.3x.
* **Compile time.** ``--schemas`` seeded random schemas (the shapes of the engine
  tests: nested objects, enums, arrays with ``maxItems``, bounded strings and integers),
  each compiled once with a fresh compiler (cold) and then again (cached): p50 and p99 ms.

Per backend (``--backends``, default both: llguidance and xgrammar; a backend whose
package is not installed is reported as such). JSON goes to ``benchmarks/results/structured.json``.

    python benchmarks/structured.py [--concurrency 16] [--rounds 3] [--schemas 50]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import RESULTS, cpu, save

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.grammar.backend import TokenizerInfo
from pipeline.grammar.compiler import BACKENDS, GrammarCompiler
from pipeline.structured_outputs import StructuredOutputsParams

MODEL = "builtin:tiny"
GOAL_RATIO = 1.3
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random object schema (every property required, no others)."""
    kinds = ["integer", "string", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 16)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "y z", "ok"], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": 4}
    names = rng.sample(["a", "b", "name", "n", "items", "ok", "v", "w"], rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def _quantile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q * 100) - 1]


async def _run_batch(engine: AsyncEngine, params: list[SamplingParams]) -> list[tuple[int, float]]:
    """(tokens, per-token seconds) of each request, all submitted at once."""
    results: list[tuple[int, float]] = []

    async def one(p: SamplingParams) -> None:
        stamps: list[float] = []
        tokens = 0
        async for out in engine.generate("Describe a person as JSON:", p):
            stamps.append(time.perf_counter())
            tokens = len(out.token_ids)
        if tokens > 1:
            results.append((tokens, (stamps[-1] - stamps[0]) / (tokens - 1)))

    async with anyio.create_task_group() as tg:
        for p in params:
            tg.start_soon(one, p)
    return results


async def _latency(concurrency: int, rounds: int, backend: str) -> dict[str, Any]:
    spec = StructuredOutputsParams(json=SCHEMA)
    config = EngineConfig(model=MODEL, max_num_seqs=concurrency, structured_outputs_backend=backend)
    async with AsyncEngine(config) as engine:
        # Warm-up (compiles the schema, fills the inline-forward estimates).
        warm = [SamplingParams(max_tokens=400, seed=i, structured_outputs=spec) for i in range(2)]
        lengths = [n for n, _ in await _run_batch(engine, warm)]
        constrained_s: list[float] = []
        plain_s: list[float] = []
        tokens: list[int] = []
        seeds = itertools.count(1000)
        for _ in range(rounds):
            params = [
                SamplingParams(
                    max_tokens=400, temperature=1.0, seed=next(seeds), structured_outputs=spec
                )
                for _ in range(concurrency)
            ]
            got = await _run_batch(engine, params)
            tokens += [n for n, _ in got]
            constrained_s += [s for _, s in got]
            length = int(statistics.median(tokens or lengths))
            plain = [
                SamplingParams(
                    max_tokens=length, temperature=1.0, seed=next(seeds), ignore_eos=True
                )
                for _ in range(concurrency)
            ]
            plain_s += [s for _, s in await _run_batch(engine, plain)]
    constrained_ms = statistics.median(constrained_s) * 1e3
    plain_ms = statistics.median(plain_s) * 1e3
    return {
        "backend": backend,
        "concurrency": concurrency,
        "rounds": rounds,
        "constrained_tokens_median": statistics.median(tokens),
        "constrained_ms_per_token": round(constrained_ms, 3),
        "unconstrained_ms_per_token": round(plain_ms, 3),
        "ratio": round(constrained_ms / plain_ms, 3),
        "goal_ratio": GOAL_RATIO,
    }


def _compile_times(backend: str, schemas: int) -> dict[str, Any]:
    from stages.structured import tokenizer_info

    info = tokenizer_info(MODEL, 512, 2)
    assert isinstance(info, TokenizerInfo)
    if backend == "llguidance":
        from pipeline.grammar.guidance import GuidanceBackend

        compiler = GrammarCompiler(GuidanceBackend(info), max_entries=schemas)
    else:
        from pipeline.grammar.xgrammar_backend import XGrammarBackend

        compiler = GrammarCompiler(XGrammarBackend(info), max_entries=schemas)
    rng = random.Random(26)
    specs = [StructuredOutputsParams(json=random_schema(rng)) for _ in range(schemas)]
    cold, cached = [], []
    for spec in specs:
        t0 = time.perf_counter()
        compiler.get(spec)
        cold.append((time.perf_counter() - t0) * 1e3)
    for spec in specs:
        t0 = time.perf_counter()
        compiler.get(spec)
        cached.append((time.perf_counter() - t0) * 1e3)
    return {
        "schemas": schemas,
        "cold_p50_ms": round(_quantile(cold, 0.5), 3),
        "cold_p99_ms": round(_quantile(cold, 0.99), 3),
        "cached_p50_ms": round(_quantile(cached, 0.5), 4),
        "cached_p99_ms": round(_quantile(cached, 0.99), 4),
    }


def _installed(backend: str) -> bool:
    try:
        __import__(backend)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument(
        "--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS, help="absent: skipped"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "structured.json")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        if not _installed(backend):
            rows.append({"backend": backend, "skipped": f"{backend} is not installed"})
            continue
        row = anyio.run(_latency, args.concurrency, args.rounds, backend)
        row["compile"] = _compile_times(backend, args.schemas)
        rows.append(row)
    print(f"\nStructured outputs on {MODEL} ({cpu()})")
    print(f"  {'backend':12s} {'json ms/tok':>12s} {'plain ms/tok':>13s} {'ratio':>6s}"
          f" {'compile p50/p99 ms':>20s} {'cached p50/p99 ms':>19s}")  # fmt: skip
    for row in rows:
        if "skipped" in row:
            print(f"  {row['backend']:12s} skipped: {row['skipped']}")
            continue
        c = row["compile"]
        print(
            f"  {row['backend']:12s} {row['constrained_ms_per_token']:12.3f}"
            f" {row['unconstrained_ms_per_token']:13.3f} {row['ratio']:6.2f}x"
            f" {c['cold_p50_ms']:9.2f}/{c['cold_p99_ms']:<9.2f}"
            f" {c['cached_p50_ms']:8.4f}/{c['cached_p99_ms']:<8.4f}"
        )
    print(f"  goal: constrained <= {GOAL_RATIO}x unconstrained per output token")
    save(args.json, {"model": MODEL, "cpu": cpu(), "schema": json.dumps(SCHEMA), "results": rows})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
