"""Routing: the same multi-tenant workloads through ``kvstep proxy`` under each policy
(``round-robin``, ``least-loaded``, ``kv-aware``), in one run.

    python benchmarks/routing.py [--scenarios poisson,memory-pressure] [--trace] [--json PATH]

Two scenarios (``--scenarios``, both by default), each run under every policy:

* ``poisson``: the workload described below (``--num-requests``, ``--request-rate``, ...).
* ``memory-pressure`` (issue 24): ``--pressure-prefixes`` 6 system prompts of exactly
  ``--pressure-prefix-tokens`` 608 tokens (38 blocks), ``--pressure-requests`` 48 user
  turns (a random tenant's system prompt and a short question), sent by
  ``--pressure-clients`` 4 closed-loop clients (each sends its next request when its
  last one finished), ``--pressure-gpu-blocks`` 84 blocks a replica: a replica holds two
  tenants' prompts, three together hold all six (ideal hit rate ~84%: all but each
  tenant's first request hit their 38 blocks). Its warm-up prompts are 4 blocks long.

``--trace`` runs the proxy under ``_routing_trace.py`` and adds, per kv-aware run, what
its index showed on the chosen replica at each decision against the blocks the replica
then stored (computed), how long a routed prompt's first block took to be announced,
how many decisions were taken while a request of the same prefix was routed and not
yet announced (and how many of those went elsewhere), replicas per prefix, prefixes per
replica and blocks evicted per replica.

Per policy, fresh processes on loopback (``_routing_policy.py``): ``--replicas``
``kvstep serve`` (``builtin:tiny``, float32 on CPU, ``OMP_NUM_THREADS=--threads``, KV
events on, a KV cache of ``--num-gpu-blocks`` blocks) and ``kvstep proxy --backend ...
--policy P --tokenizer builtin:tiny`` (the kv-aware policy hashes the text prompts as
the replicas do and follows their events, found in their ``/health``). The replicas are
new for every policy, so each starts with an empty cache; they get ``--warmup``
requests each (prompts unrelated to the workload) straight, then one goes through the
proxy (under kv-aware, until the proxy routes by a cached block: it follows the
events). ``/metrics`` of the replicas and the proxy are scraped, the workload runs,
they are scraped again; the policy's numbers are the differences. Then everything is
stopped before the next policy starts.

Workload (``benchmarks/serve.py``'s, all drawn from ``--seed``, the same for every
policy): ``--num-prefixes`` tenants, each with a long system prompt (``--prefix-words``
words, about 2 ``builtin:tiny`` tokens a word), and ``--num-requests`` user turns, each
a random tenant's system prompt followed by a short unique question
(``--suffix-words``), sent as a Poisson process of ``--request-rate`` requests/s
(streamed ``/v1/completions``, ``--output-tokens`` tokens with ``ignore_eos``).
Each replica's cache holds ``--cache-share`` (default 1 / replicas) of all the tenants'
prompt blocks plus ``--headroom-blocks`` for the questions in flight: one replica
cannot hold every tenant, three together can.

Reported per policy:

* **hit rate**: prompt tokens the replicas took from their prefix caches over all prompt
  tokens (``kvstep_prefix_cache_hits_total / kvstep_prefix_cache_queries_total``,
  summed over the replicas); ``proxy est.`` is the kv-aware proxy's own estimate
  (``kvstep_proxy_routed_hit_blocks_total / kvstep_proxy_routed_prompt_blocks_total``:
  the blocks its index said the chosen replica held).
* **TTFT** p50/p99/mean: send to first token chunk, at the client, through the proxy.
* **decision p99**: ``kvstep_proxy_route_decision_seconds`` (kv-aware only: the index
  lookup and scoring; its buckets are a factor 3 apart, so the p99 is a bucket
  interpolation). Tokenizing and hashing the prompt comes before it and is not in it;
  ``hash p50/p99`` times that part here, in this process, over the workload's prompts.
* **requests per replica**: requests each replica finished (``kvstep_requests_total``).

The goal (issues 14 and 24): on each scenario, kv-aware's hit rate at least 2x
round-robin's and its mean TTFT at least 1.5x lower. Recorded run (both scenarios, all
policies, ``--trace``, about 7 min on a 2-CPU AMD EPYC box shared with other work, so
compare policies within a run only; 1-min load average 0.4-4.5):

* poisson (system prompts of 112 blocks, 463 blocks a replica): round-robin 38.8% hit,
  mean TTFT 157.9 ms (p50 147.2); least-loaded 38.8%, 115.2 ms (p50 134.0); kv-aware
  90.6% (its own estimate 91.0%), 47.7 ms (p50 34.6): x2.34 the hit rate, x3.31 lower
  mean TTFT; decisions 121 us on average.
* memory-pressure: round-robin 26.6%, 83.6 ms (p50 84.1); least-loaded 26.5%, 74.4 ms
  (p50 73.3); kv-aware 83.0%, 51.9 ms (p50 43.0): x3.12 the hit rate, x1.61 lower mean
  TTFT; each replica was given 2 of the 6 prefixes and no prefix went to two replicas.
  Before issue 24's policy (blocks of a routed request counted as held until announced,
  the eviction term, ties to the replica with the fewest recent blocks) kv-aware hit
  61.5-77.5% there over seeds 0-3: a replica was given 3 or 4 prefixes and evicted
  150-180 blocks, and requests of a prefix still in prefill were sent elsewhere.

Round-robin's hit rate cannot go much lower than a third: each replica caches a third
of the tenants, and a prefix evicted from the tail first still hits in part. JSON goes
to ``benchmarks/results/routing.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _results import RESULTS, save
from _routing_policy import MODEL, Scenario, Setup, run_policy
from _serve_client import WORDS, RequestSpec, build_workload
from _serve_metrics import SAMPLE_QUANTILE
from serve import _range

POLICIES = ("round-robin", "least-loaded", "kv-aware")
BLOCK_SIZE = 16  # kvstep serve's default, which the proxy assumes too


def tenant_blocks(specs: Sequence[RequestSpec]) -> tuple[dict[int, int], list[float]]:
    """Full blocks of each tenant's system prompt, and the time to tokenize and hash each
    whole prompt as the kv-aware proxy does (seconds, in this process)."""
    from pipeline.kv_events import prompt_block_hashes
    from pipeline.tokenizer import load_tokenizer
    from stages.model.builtin import tokenizer_dir

    tokenizer = load_tokenizer(tokenizer_dir(MODEL))
    assert tokenizer is not None, "builtin:tiny carries a tokenizer"
    blocks = {}
    times = []
    for spec in specs:
        if spec.prefix not in blocks:  # the system prompt ends at the first full stop
            system = spec.prompt[: spec.prompt.index(".") + 1]
            blocks[spec.prefix] = len(tokenizer.encode(system)) // BLOCK_SIZE
        start = time.perf_counter()
        prompt_block_hashes(tokenizer.encode(spec.prompt), BLOCK_SIZE)
        times.append(time.perf_counter() - start)
    return blocks, times


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """kv-aware against round-robin: the issue's two ratios and whether both are met."""
    if "kv-aware" not in rows or "round-robin" not in rows:
        return None
    kv, rr = rows["kv-aware"], rows["round-robin"]
    hit_ratio = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
    speedup = rr["ttft_mean_s"] / kv["ttft_mean_s"]
    return {
        "hit_rate_ratio": hit_ratio,
        "mean_ttft_speedup": speedup,
        "goal_met": bool(hit_ratio >= 2.0 and speedup >= 1.5),
    }


def print_report(result: dict[str, Any], replicas: int, cpu_count: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    work = result["workload"]
    title = (
        f"{result['scenario']}: kvstep proxy, {replicas} x {MODEL}: {work['num_requests']} "
        f"requests of {work['num_prefixes']} tenants, {work['arrival']}, "
        f"{result['num_gpu_blocks']} KV blocks a replica"
    )
    table = Table(title=title)
    for name in ("policy", "hit rate", "proxy est.", "TTFT p50", "p99", "mean"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for name in ("decision p99/mean", "requests per replica", "failed", "time", "load"):
        table.add_column(name, justify="right")
    for row in result["policies"]:
        table.add_row(
            row["policy"],
            _pct(row["hit_rate"]),
            _pct(row["proxy_hit_estimate"]),
            _ms(row["ttft_p50_s"]),
            _ms(row["ttft_p99_s"]),
            _ms(row["ttft_mean_s"]),
            _us(row["route_decision_p99_s"], row["route_decision_mean_s"]),
            " / ".join(f"{n:.0f}" for n in row["requests_per_replica"]),
            str(row["failed"]),
            f"{row['duration_s']:.0f} s",
            "{:.1f}-{:.1f}".format(*row["load_average_1m"]),
        )
    console.print(table)
    console.print(
        f"TTFT in ms, at the client through the proxy; hit rate: prompt tokens from the "
        f"replicas' prefix caches / all prompt tokens; mean prompt "
        f"{work['mean_prompt_tokens']:.0f} tokens, system prompts "
        f"{work['mean_tenant_blocks']:.0f} blocks on average; "
        f"tokenize+hash a prompt here: p50 {_ms(result['hash_p50_s'])} ms, "
        f"p99 {_ms(result['hash_p99_s'])} ms (before the decision, not in it); "
        f"load: 1-min load average before-after ({cpu_count} CPUs)"
    )
    for row in result["policies"]:
        console.print(
            f"{row['policy']}: hit rate per replica "
            + " / ".join(_pct(x) for x in row["hit_rate_per_replica"])
            + (
                ", the proxy's estimate "
                + " / ".join(_pct(x) for x in row["proxy_hit_estimate_per_replica"])
                if row["policy"] == "kv-aware"
                else ""
            )
        )
        trace = row.get("trace")
        if trace and trace.get("decisions"):
            console.print(
                f"  trace: {trace['decisions']} decisions, {trace['prompt_blocks']} prompt "
                f"blocks; the index showed {trace['believed_hit_blocks']} on the chosen "
                f"replica, it stored (computed) {trace['computed_blocks']}; first block "
                f"announced {_ms(trace['announce_delay_p50_s'] or math.nan)} ms after the "
                f"decision (p50); {trace['decisions_with_same_prefix_unannounced']} "
                f"decisions while a request of the same prefix was unannounced, "
                f"{trace['of_which_sent_elsewhere']} of them sent elsewhere; "
                f"{trace['replicas_per_prefix']:.2f} replicas per prefix, prefixes per "
                f"replica {trace['prefixes_per_replica']}, blocks evicted "
                f"{trace['removed_blocks_per_replica']}"
            )
    goal = result["kv_aware_vs_round_robin"]
    if goal is not None:
        console.print(
            f"kv-aware vs round-robin: hit rate x{goal['hit_rate_ratio']:.2f} (goal >= 2), "
            f"mean TTFT x{goal['mean_ttft_speedup']:.2f} lower (goal >= 1.5): "
            f"{'met' if goal['goal_met'] else 'NOT met'}"
        )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _us(p99: float, mean: float) -> str:
    return "-" if math.isnan(p99) else f"{p99 * 1e6:.0f}/{mean * 1e6:.0f} us"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1%}"


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"want some of {','.join(POLICIES)}, got {text!r}")
    return names


def _scenarios(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"want some of {','.join(SCENARIOS)}, got {text!r}")
    return names


def poisson_scenario(args: argparse.Namespace) -> Scenario:
    """The multi-tenant Poisson workload of the flags (see the module)."""
    specs = build_workload(args, args.num_requests, args.seed)
    warmup = build_workload(args, args.replicas * args.warmup + 1, args.seed + 1)
    blocks, hash_times = tenant_blocks(specs)
    share = args.cache_share if args.cache_share is not None else 1.0 / args.replicas
    # every tenant's blocks, also those the workload happened not to draw
    mean_blocks = statistics.mean(blocks.values())
    num_gpu_blocks = math.ceil(share * mean_blocks * args.num_prefixes) + args.headroom_blocks
    workload = {
        "arrival": f"Poisson, {args.request_rate:g} req/s",
        "num_requests": args.num_requests,
        "request_rate": args.request_rate,
        "seed": args.seed,
        "num_prefixes": args.num_prefixes,
        "prefix_words": list(args.prefix_words),
        "suffix_words": list(args.suffix_words),
        "output_tokens": list(args.output_tokens),
        "mean_tenant_blocks": mean_blocks,
        "cache_share": share,
    }
    return Scenario("poisson", specs, warmup, num_gpu_blocks, None, workload, hash_times)


def pressure_scenario(args: argparse.Namespace) -> Scenario:
    """Issue 24's memory-pressure workload (see the module)."""
    from pipeline.tokenizer import load_tokenizer
    from stages.model.builtin import tokenizer_dir

    tokenizer = load_tokenizer(tokenizer_dir(MODEL))
    rng = random.Random(args.seed + 7)
    prefixes = [
        _prompt_of(tokenizer, rng, args.pressure_prefix_tokens)
        for _ in range(args.pressure_prefixes)
    ]
    specs = []
    for _ in range(args.pressure_requests):
        which = rng.randrange(len(prefixes))
        suffix = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*args.suffix_words)))
        tokens = rng.randint(*args.output_tokens)
        specs.append(RequestSpec(0.0, f"{prefixes[which]} {suffix}", which, tokens))
    # warm-up prompts share nothing with the workload and are short (4 blocks)
    warmup = [
        RequestSpec(0.0, _prompt_of(tokenizer, rng, 4 * BLOCK_SIZE), -1, 2)
        for _ in range(args.replicas * args.warmup + 1)
    ]
    blocks, hash_times = tenant_blocks(specs)
    workload = {
        "arrival": f"closed loop, {args.pressure_clients} clients",
        "num_requests": args.pressure_requests,
        "clients": args.pressure_clients,
        "seed": args.seed,
        "num_prefixes": args.pressure_prefixes,
        "prefix_tokens": args.pressure_prefix_tokens,
        "suffix_words": list(args.suffix_words),
        "output_tokens": list(args.output_tokens),
        "mean_tenant_blocks": statistics.mean(blocks.values()),
    }
    return Scenario(
        "memory-pressure",
        specs,
        warmup,
        args.pressure_gpu_blocks,
        args.pressure_clients,
        workload,
        hash_times,
    )


def _prompt_of(tokenizer: Any, rng: random.Random, tokens: int) -> str:
    """Random words and a full stop that ``tokenizer`` encodes to exactly ``tokens``
    tokens (the builtin tokenizer encodes a space and "a" as one token)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words) + ".")) < tokens:
        words.append(rng.choice(WORDS))
    while len(tokenizer.encode(" ".join(words) + ".")) > tokens:
        words.pop()
    while len(tokenizer.encode(" ".join(words) + ".")) < tokens:
        words.append("a")
    text = " ".join(words) + "."
    assert len(tokenizer.encode(text)) == tokens, "the builtin tokenizer merged a filler"
    return text


SCENARIOS = {"poisson": poisson_scenario, "memory-pressure": pressure_scenario}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", type=_scenarios, default=tuple(SCENARIOS))
    parser.add_argument("--policies", type=_policies, default=POLICIES, help="comma-separated")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=2.0, help="requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prefixes", type=int, default=12, help="tenants")
    parser.add_argument("--prefix-words", type=_range, default=(800, 1000), help="LOW,HIGH")
    parser.add_argument("--suffix-words", type=_range, default=(8, 24), help="LOW,HIGH")
    parser.add_argument("--output-tokens", type=_range, default=(2, 6), help="LOW,HIGH")
    parser.add_argument(
        "--cache-share", type=float, default=None,
        help="of all system prompts' blocks, what one replica's cache holds (default: 1/replicas)",
    )  # fmt: skip
    parser.add_argument("--headroom-blocks", type=int, default=16)
    parser.add_argument("--pressure-requests", type=int, default=48)
    parser.add_argument("--pressure-clients", type=int, default=4)
    parser.add_argument("--pressure-prefixes", type=int, default=6)
    parser.add_argument("--pressure-prefix-tokens", type=int, default=608)
    parser.add_argument("--pressure-gpu-blocks", type=int, default=84)
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per replica")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="passed to kvstep serve (repeat)"
    )
    parser.add_argument(
        "--trace", action="store_true",
        help="record the kv-aware proxy's decisions and the events it applied, and compare",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "routing.json")
    args = parser.parse_args(argv)

    scenarios = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios:
            scenario = SCENARIOS[name](args)
            setup = Setup(
                num_gpu_blocks=scenario.num_gpu_blocks,
                replicas=args.replicas,
                threads=args.threads,
                warmup=args.warmup,
                server_args=tuple(args.server_arg),
                clients=scenario.clients,
                trace=args.trace,
            )
            rows = {}
            for policy in args.policies:
                logs = Path(tmp) / name
                rows[policy] = run_policy(setup, policy, scenario.specs, scenario.warmup, logs)
            prompt_tokens = [r["prompt_tokens"] / max(1, r["completed"]) for r in rows.values()]
            hash_p50, hash_p99 = np.quantile(
                scenario.hash_times, [0.5, 0.99], method=SAMPLE_QUANTILE
            )
            result = {
                "scenario": name,
                "num_gpu_blocks": scenario.num_gpu_blocks,
                "workload": {
                    **scenario.workload,
                    "mean_prompt_tokens": statistics.mean(prompt_tokens),
                },
                "hash_p50_s": float(hash_p50),
                "hash_p99_s": float(hash_p99),
                "policies": list(rows.values()),
                "kv_aware_vs_round_robin": compare(rows),
            }
            print_report(result, args.replicas, os.cpu_count())
            scenarios.append(result)
    result = {
        "model": MODEL,
        "replicas": args.replicas,
        "threads": args.threads,
        "fresh_replicas_per_policy": True,
        "server_args": list(args.server_arg),
        "cpu_count": os.cpu_count(),
        "scenarios": scenarios,
    }
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
