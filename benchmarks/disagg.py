"""Disaggregated prefill/decode over NIXL (issue 13): transfer bandwidth, consumer TTFT
with a full remote hit, and decode ITL while long prompts arrive, each against its
baseline in the same run.

    python benchmarks/disagg.py [--parts 1,2,3] [--json PATH]

1. **Transfer** (``_disagg_transfer.py``): the KV of a ``--transfer-prompt-len`` prompt
   of the model (every full block but the last prompt token's, as the connector reads
   it; float32, the model's dtype on CPU) moved by a NIXL READ from a producer
   ``KVAgent`` in another process, against ``copy_`` of the same blocks in this
   process. Median GB/s of ``--transfer-repeats`` reads. Goal: READ >= 50% of memcpy.
2. **TTFT** (``_disagg_ttft.py``): two engines in this process, a producer and a
   consumer; the consumer's time to first token with ``do_remote_prefill`` params
   (full remote hit) against the same consumer recomputing the prompt. Medians over
   ``--prompts`` prompts per length of ``--prompt-lens``. Goal: >= 5x.
3. **ITL** (``_disagg_itl.py``): a colocated ``kvstep serve`` against producer +
   consumer + ``kvstep proxy`` (``builtin:tiny``: one step of 4 streams of the ~100M
   model takes about 120 ms on one core here, too slow for enough samples in the time
   budget), decode streams' inter-token latency with long prompts arriving at a steady
   rate and with none. Goal: disaggregated p99 loaded <= 1.5x its no-load p99.
   ``--pin`` adds a pinned layout, measured beside (never instead of) the unpinned one,
   with the same processes re-pinned before each round: the producer on one core; the
   consumer, proxy and client on another; the colocated server and its client on both
   (why: ``_disagg_procs.py``). "CPU wait": seconds the decode engine's threads waited
   runnable for a core per second they ran (``_sched_stats.py``), no-load -> loaded,
   which tells contention from the engine's own work. ``--step-logs DIR`` keeps the
   servers' step logs there and adds the decode engine's step period, the gap between
   its steps, and the period by kind of step (``_disagg_steps.py``).

The model of parts 1-2 is the ~100M random Llama of ``benchmarks/kv_reuse.py`` (12
layers, 4 KV heads of 64; ``--model small`` is a 2-layer one, for a smoke run).
``--threads`` is this process's torch threads (parts 1-2) and each server process's
``OMP_NUM_THREADS`` (part 3): default 1, since two engine processes share this
machine's 2 cores in part 3 (and the colocated server then has one core to itself
beside the client and proxy). Colocated and disaggregated run on the same cores here,
so unless ``--pin`` the disaggregated producer's prefill competes with its consumer's
decode for CPU. Nothing asserts timings. JSON goes to ``benchmarks/results/disagg.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from _disagg_itl import Workload
from _disagg_itl_table import GOAL as ITL_GOAL
from _disagg_itl_table import print_itl
from _models import save_random_llama
from _results import RESULTS, save
from kv_reuse import BLOCK, build_model

GOALS = {"transfer_vs_memcpy": 0.5, "ttft_speedup": 5.0, "disagg_p99_vs_no_load": ITL_GOAL}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build(path: Path, size: str) -> tuple[int, dict[str, Any]]:
    """Save the model of parts 1-2; returns its parameter count and ``config.json``."""
    if size == "100m":
        params = build_model(path)
    else:
        params = save_random_llama(
            path,
            0,
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
    return params, json.loads((path / "config.json").read_text())


def run_model_parts(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import _disagg_transfer
    import _disagg_ttft

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"llama-{args.model}"
        params, config = build(path, args.model)
        heads = config["num_attention_heads"]
        shape = _disagg_transfer.KVShape(
            layers=config["num_hidden_layers"],
            block_size=BLOCK,
            kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )
        result["model"] = {"size": args.model, "parameters": params, "kv_shape": str(shape)}
        if 1 in args.parts:
            result["transfer"] = _disagg_transfer.measure(
                shape, args.transfer_prompt_len, args.transfer_repeats
            )
        if 2 in args.parts:
            result["ttft"] = _disagg_ttft.measure(
                path, args.prompt_lens, args.prompts, config["vocab_size"]
            )


def print_report(result: dict[str, Any]) -> None:
    model = result.get("model", {})
    print(
        f"machine: {result['cpu_count']} CPUs, 1-min load average {result['load_before']:.1f} "
        f"before, {result['load_after']:.1f} after; threads per process: {result['threads']}; "
        f"{result['elapsed_s']:.0f} s"
    )
    if "transfer" in result:
        t = result["transfer"]
        print(
            f"\n1. KV transfer, {model['parameters'] / 1e6:.0f}M model {model['kv_shape']}: "
            f"{t['blocks']} blocks of a {t['prompt_len']}-token prompt, "
            f"{t['bytes'] / 2**20:.1f} MiB float32, {t['descriptors_per_read']} descriptors"
        )
        print(f"   {'':<30}{'GB/s':>8}   (median of {t['repeats']})")
        print(f"   {'NIXL READ (other process)':<30}{t['nixl_read_GBps']:>8.2f}")
        print(f"   {'memcpy (copy_, same blocks)':<30}{t['memcpy_GBps']:>8.2f}")
        verdict = _goal(t["nixl_vs_memcpy"] >= GOALS["transfer_vs_memcpy"])
        print(
            f"   READ / memcpy = {t['nixl_vs_memcpy']:.0%} (goal >= 50%: {verdict}); "
            f"start_read itself took {t['start_read_share']:.0%} of the read; UCX_TLS "
            f"{t['ucx_tls']}; data checked: {t['read_correct']}"
        )
    if "ttft" in result:
        print(f"\n2. consumer TTFT, {model['parameters'] / 1e6:.0f}M model, two engines in-process")
        print(
            f"   {'prompt':>6}{'recompute ms':>14}{'remote hit ms':>15}{'speedup':>9}"
            f"{'loaded':>8}{'producer ms':>13}  same"
        )
        for row in result["ttft"].values():
            print(
                f"   {row['prompt_len']:>6}{row['ttft_recompute_s'] * 1e3:>14.1f}"
                f"{row['ttft_remote_hit_s'] * 1e3:>15.1f}{row['speedup']:>8.1f}x"
                f"{row['loaded_tokens']:>8.0f}{row['producer_prefill_s'] * 1e3:>13.1f}"
                f"  {row['identical_first_token']}"
            )
        print(f"   goal >= 5x; medians of {next(iter(result['ttft'].values()))['prompts']} prompts")
    if "itl" in result:
        print_itl(result)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _goal(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", type=_ints, default=[1, 2, 3], help="which parts, e.g. 1,3")
    parser.add_argument("--model", choices=("100m", "small"), default="100m", help="parts 1-2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--transfer-prompt-len", type=int, default=2048)
    parser.add_argument("--transfer-repeats", type=int, default=10)
    parser.add_argument("--prompt-lens", type=_ints, default=[512, 2048], help="part 2")
    parser.add_argument("--prompts", type=int, default=3, help="part 2: prompts per length")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-max-tokens", type=int, default=4)
    parser.add_argument("--rate", type=float, default=2.0, help="long prompts per second")
    parser.add_argument("--long-inflight", type=int, default=2, help="most unanswered")
    parser.add_argument("--rounds", type=int, default=3, help="part 3: rounds per workload")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="part 3: also measure with the producer and the consumer on separate cores",
    )
    parser.add_argument(
        "--step-logs",
        type=Path,
        metavar="DIR",
        help="part 3: the servers' output and step logs go to DIR (kept); the report "
        "adds the decode engine's steps",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "disagg.json")
    args = parser.parse_args(argv)

    if importlib.util.find_spec("nixl_cu12") is None or importlib.util.find_spec("zmq") is None:
        print("nixl is not installed (pip install 'kvstep[nixl]'); nothing to measure")
        skipped: dict[str, Any] = {"skipped": "nixl_cu12 or pyzmq is not installed"}
        save(args.json, skipped)
        return skipped
    torch.set_num_threads(args.threads)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    result: dict[str, Any] = {"parts": args.parts, "threads": args.threads}
    if 1 in args.parts or 2 in args.parts:
        run_model_parts(args, result)
    if 3 in args.parts:
        import _disagg_itl

        work = Workload(
            streams=args.streams,
            stream_tokens=args.stream_tokens,
            long_tokens=args.long_tokens,
            long_max_tokens=args.long_max_tokens,
            rate=args.rate,
            long_inflight=args.long_inflight,
            rounds=args.rounds,
            threads=args.threads,
        )
        result["workload"] = attrs.asdict(work)
        with contextlib.ExitStack() as stack:
            logs = args.step_logs or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            logs.mkdir(parents=True, exist_ok=True)
            itl = _disagg_itl.measure(work, logs, step_logs=bool(args.step_logs), pinned=args.pin)
            result["itl"] = itl["unpinned"]
            if args.pin:
                result["itl_pinned"] = itl["pinned"]
    result.update(
        elapsed_s=time.perf_counter() - start,
        load_before=load_before,
        load_after=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
        goals=GOALS,
    )
    print_report(result)
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
