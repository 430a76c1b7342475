"""The report of ``throughput.py --serving`` (see ``_throughput_serving.py``): each run's
throughput and TTFT/ITL/E2E quantiles (``serve.py``'s definitions), the baseline's padding,
greedy agreement, and the table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from _serve_metrics import QUANTILES, SAMPLE_QUANTILE

if TYPE_CHECKING:
    from _throughput_serving import Job

TARGET_RATIO = 1.3  # issue 15: kvstep's saturation throughput over the baseline's


def summarize(jobs: Sequence[Job], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Throughput and TTFT/ITL/E2E quantiles of one (engine, scenario) run."""
    ttft = [r["times"][0] - j.arrival_s for j, r in zip(jobs, records, strict=True)]
    e2e = [r["times"][-1] - j.arrival_s for j, r in zip(jobs, records, strict=True)]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:], strict=False)]
    makespan = max(r["times"][-1] for r in records)
    tokens = sum(len(r["tokens"]) for r in records)
    row: dict[str, Any] = {
        "makespan_s": makespan,
        "output_tokens": tokens,
        "output_tok_s": tokens / makespan,
        "requests_s": len(records) / makespan,
    }
    for name, samples in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in QUANTILES:
            value = np.quantile(samples, q, method=SAMPLE_QUANTILE)
            row[f"{name}_p{round(q * 100)}_s"] = float(value)
    return row


def waste(jobs: Sequence[Job], records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The baseline's padding: the share of its batches' prefill positions that were pads,
    and of its decode rows (a row per request per step) past the request's own length."""
    batches = [r["batch"] for r in records]
    prompt = sum(len(j.prompt) for j in jobs) / sum(b["width"] for b in batches)
    decode = sum(j.max_tokens for j in jobs) / sum(b["steps"] for b in batches)
    return {
        "transformers_batches": len({b["index"] for b in batches}),
        "transformers_wasted_prefill": 1 - prompt,
        "transformers_wasted_decode": 1 - decode,
    }


def same(a: Sequence[list[int]], b: Sequence[list[int]]) -> float:
    """The share of requests (of the shorter list) whose greedy tokens agree exactly."""
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(min(len(a), len(b)), 1)


def print_table(result: dict[str, Any]) -> None:
    """The table: per scenario and engine, throughput and TTFT/ITL p50/p99, then the ratio."""
    low, high, total = result["prompt_tokens"]
    print(
        f"{result['num_requests']} requests, prompts {low}..{high} tokens ({total} in all), "
        f"outputs {result['output_tokens']}, batch {result['batch']}, "
        f"{result['dtype']}, {result['threads']} threads"
    )
    head = f"{'scenario':<12}{'engine':<14}{'tok/s':>9}{'req/s':>8}"
    print(head + "".join(f"{m:>12}" for m in ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99")))
    for run in result["runs"]:
        variants = [k for k, v in run.items() if k.startswith("kvstep-") and isinstance(v, dict)]
        for engine in ("transformers", "kvstep", *variants):
            if engine not in run:
                continue
            row = run[engine]
            cells = f"{run['scenario']:<12}{engine:<14}"
            cells += f"{row['output_tok_s']:>9.1f}{row['requests_s']:>8.2f}"
            for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
                cells += f"{row[key] * 1e3:>10.1f}ms"
            print(cells)
        print(
            f"{run['scenario']}: kvstep/transformers {run['ratio']:.2f}x; kvstep served "
            f"{run['kvstep_cached_prompt_tokens']} prompt tokens from its prefix cache; "
            f"transformers wasted {run['transformers_wasted_prefill']:.0%} of its prefill "
            f"and {run['transformers_wasted_decode']:.0%} of its decode rows on padding; "
            f"identical greedy outputs kvstep=transformers "
            f"{run['identical_kvstep_vs_transformers']:.0%}, vs the unpadded reference "
            f"kvstep {run['identical_kvstep_vs_reference']:.0%}, transformers "
            f"{run['identical_transformers_vs_reference']:.0%}"
        )
        for engine in variants:
            if engine in run:
                ratio = run[engine]["output_tok_s"] / run["kvstep"]["output_tok_s"]
                print(
                    f"{run['scenario']}: {engine} / kvstep {ratio:.3f}x; identical outputs "
                    f"{run[f'{engine}_identical']:.0%}"
                )
    if "saturation_ratio" in result:
        verdict = "meets" if result["meets_target"] else "MISSES"
        print(
            f"saturation throughput kvstep/transformers {result['saturation_ratio']:.2f}x "
            f"({verdict} the {TARGET_RATIO}x target)"
        )
