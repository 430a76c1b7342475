"""The decode step with the decode KV mirror on and off (issue 27).

Two runners of one random Llama (hidden 512, 8 heads, 4 KV heads, head_dim 64, 4 layers),
one with ``decode_mirror`` and one without, prefill the same ``batch`` requests (contexts
350-520), then run decode-only steps, alternating on and off in rounds so that both share
a shared machine's drift. Prints the best and median step time of each and the ratio.

    python benchmarks/decode_mirror.py [--dtypes bfloat16 float32] [--batches 1 8 64]
        [--rounds 6] [--steps 5] [--json PATH]

Prints a table (one row per dtype and batch); JSON: ``benchmarks/results/decode_mirror.json``.

AMX Xeon, 2 cores, best (median) on/off: bfloat16 batch 64 0.84 (0.91), 8 0.86 (0.90),
1 0.99 (0.99); float32 batch 64 0.36 (0.24), 8 0.76 (0.83), 1 0.95 (0.95) (mirror then
position-major). AMD EPYC (AVX512-BF16, no AMX), 2 cores, head-major mirror: bfloat16
batch 64 0.59 (0.55; 24.5 vs 41.4 ms), 8 0.99 (1.01), 1 1.04 (1.04); float32 batch 64
0.29 (0.28), 8 0.82 (0.85), 1 1.01 (1.00).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _models import save_random_llama
from _results import RESULTS, cpu, save

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from stages.model import ModelRunner

MODEL = dict(
    vocab_size=1000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


def _req(
    rid: str, tokens: list[int], computed: int, blocks: list[int], new: bool
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=rid,
        token_ids=tuple(tokens),
        num_computed_tokens=computed,
        block_ids=tuple(blocks),
        new=new,
        sampling=GREEDY,
        sample=True,
        num_output_tokens=0,
    )


def measure(path: Path, dtype: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row: ``n`` requests' decode steps in ``dtype``, mirror on and off."""
    rng = random.Random(0)
    ctx = [rng.randrange(350, 520) for _ in range(n)]
    per = -(-(max(ctx) + args.rounds * args.steps * 2 + 1) // BLOCK)
    common = dict(device="cpu", dtype=dtype, num_blocks=n * per + 1,
                  block_size=BLOCK, max_model_len=1024, max_num_seqs=n)  # fmt: skip
    runners = {
        "on": ModelRunner.load(str(path), decode_mirror=True, inline_forward=True, **common),
        "off": ModelRunner.load(str(path), decode_mirror=False, inline_forward=True, **common),
    }
    tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    prompts = [[rng.randrange(1000) for _ in range(c)] for c in ctx]
    computed = {name: list(ctx) for name in runners}
    step_id = 0
    for runner in runners.values():
        for i in range(n):  # one prefill per request: a step of ~400 tokens
            step_id += 1
            first = (_req(f"r{i}", prompts[i], 0, tables[i], True),)
            runner.execute(SchedulerOutput(step_id=step_id, requests=first))
    times: dict[str, list[float]] = {name: [] for name in runners}

    def decode(name: str) -> float:
        nonlocal step_id
        step_id += 1
        c = computed[name]
        reqs = tuple(_req(f"r{i}", [7], c[i], [], False) for i in range(n))
        start = perf_counter()
        runners[name].execute(
            SchedulerOutput(step_id=step_id, requests=reqs, finished_req_ids=frozenset())
        )
        elapsed = perf_counter() - start
        computed[name] = [x + 1 for x in c]
        return elapsed

    for name in runners:
        decode(name)  # warm-up (the mirror's first step gathers every context)
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            times[name] += [decode(name) for _ in range(args.steps)]
    for runner in runners.values():
        runner.close()
    best = {k: min(v) * 1e3 for k, v in times.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"dtype": dtype, "batch": n, "off_best_ms": round(best["off"], 3),
            "off_median_ms": round(med["off"], 3), "on_best_ms": round(best["on"], 3),
            "on_median_ms": round(med["on"], 3),
            "ratio_best": round(best["on"] / best["off"], 3),
            "ratio_median": round(med["on"] / med["off"], 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="decode steps per round")
    parser.add_argument("--json", type=Path, default=RESULTS / "decode_mirror.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_random_llama(path, **MODEL)
        rows = [measure(path, d, b, args) for d in args.dtypes for b in args.batches]
    print(f"CPU: {cpu()}; {torch.get_num_threads()} threads; decode step, ms (best / median)")
    print(f"{'dtype':<10}{'batch':>6}{'off':>16}{'on':>16}{'on/off':>14}")
    for r in rows:
        off = f"{r['off_best_ms']:.2f}/{r['off_median_ms']:.2f}"
        on = f"{r['on_best_ms']:.2f}/{r['on_median_ms']:.2f}"
        ratio = f"{r['ratio_best']:.2f}/{r['ratio_median']:.2f}"
        print(f"{r['dtype']:<10}{r['batch']:>6}{off:>16}{on:>16}{ratio:>14}")
    result = {"cpu": cpu(), "threads": torch.get_num_threads(), "rounds": args.rounds,
              "steps": args.steps, "results": rows}  # fmt: skip
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
