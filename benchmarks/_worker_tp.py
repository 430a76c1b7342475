"""Part 2 of ``workers.py``: generated tokens/s with TP=1 in-process, TP=1 in a worker
process and TP=2 over two worker processes, with their greedy outputs compared."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pipeline import LLM, EngineConfig, SamplingParams

WORKERS = Path(__file__).with_name("workers.py")  # its ``--child`` runs the in-process engine
# The engines: (label, executor, world size); the first is the reference.
TP_VARIANTS = (("TP1 inprocess", "inprocess", 1), ("TP1 multiproc", "multiproc", 1),
               ("TP2 multiproc", "multiproc", 2))  # fmt: skip


# ------------------------------------------------------------ part 2: tokens/s, TP=2


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def tp_config(executor: str, world_size: int, path: Path, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        executor=executor,
        world_size=world_size,
        max_num_batched_tokens=args.prompts * args.prompt_len,
        max_num_seqs=args.prompts,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        enable_prefix_caching=False,
    )


def best_generate(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    """Best of ``--repeats`` timed ``generate`` runs after one untimed run, and the tokens."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 8192, (args.prompts, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if i:
            times.append(time.perf_counter() - t0)
    errors = [(o.request_id, o.error) for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{llm.config.executor}/{llm.config.world_size} failed: {errors}")
    executor, world_size = llm.config.executor, llm.config.world_size
    threads = torch.get_num_threads() if executor == "inprocess" else cores() // world_size
    return {
        "seconds": min(times),
        "threads_per_rank": max(1, threads),
        "tokens": [list(o.token_ids) for o in outs],
    }


def run_inprocess(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The TP=1 in-process engine (run in a child process of its own)."""
    start = time.perf_counter()
    with LLM(tp_config("inprocess", 1, path, args)) as llm:
        start_s = time.perf_counter() - start
        return {**best_generate(llm, args), "start_s": start_s}


def run_multiproc(path: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The multiproc engines, started together (their worker processes' starts overlap),
    then measured one after the other while the others idle."""
    variants = [v for v in TP_VARIANTS if v[1] == "multiproc"]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(variants)) as pool:
        start = time.perf_counter()
        futures = [pool.submit(LLM, tp_config(e, n, path, args)) for _, e, n in variants]
        llms, errors = [], []
        for future in futures:  # every start is awaited, so none is left open on error
            try:
                llms.append(stack.enter_context(future.result()))
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        start_s = time.perf_counter() - start
        return {
            label: {**best_generate(llm, args), "start_s": start_s}
            for (label, _, _), llm in zip(variants, llms, strict=True)
        }


def _in_subprocess(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """An in-process engine runs in a fresh process (see ``throughput.py``: torch state
    left by earlier torch work on other threads, here part 1's, slows it down)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, str(WORKERS), "--child", "--model-path", str(path),
               "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def measure_tp(args: argparse.Namespace) -> dict[str, Any]:
    from throughput import build_model  # the same ~30M Llama as throughput.py

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        t0 = time.perf_counter()
        params = build_model(path)
        model_config = json.loads((path / "config.json").read_text())
        t1 = time.perf_counter()
        runs[TP_VARIANTS[0][0]] = _in_subprocess(path, args)
        t2 = time.perf_counter()
        # The multiproc engines run from this process: their model runs in worker
        # processes, which start fresh anyway.
        runs.update(run_multiproc(path, args))
        t3 = time.perf_counter()
    phases = {"build_model_s": t1 - t0, "inprocess_child_s": t2 - t1, "multiproc_s": t3 - t2}
    total = args.prompts * args.new_tokens
    ref_label = TP_VARIANTS[0][0]
    ref = runs[ref_label]["tokens"]
    rows = {}
    for label, executor, world_size in TP_VARIANTS:
        run = runs[label]
        same = sum(a == b for a, b in zip(ref, run["tokens"], strict=True)) / len(ref)
        rows[label] = {
            "executor": executor,
            "world_size": world_size,
            "threads_per_rank": run["threads_per_rank"],
            "start_s": round(run["start_s"], 2),
            "seconds": round(run["seconds"], 3),
            "tok_s": round(total / run["seconds"], 1),
            "match_vs_tp1_inprocess": same,
        }
    tp1, mp1, tp2 = (rows[label]["tok_s"] for label, _, _ in TP_VARIANTS)
    outputs = [runs[label]["tokens"] for label, _, _ in TP_VARIANTS]
    all_three = sum(a == b == c for a, b, c in zip(*outputs, strict=True)) / len(ref)
    return {
        "model_parameters": params,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "runs": rows,
        "ratio_tp2_vs_tp1_inprocess": round(tp2 / tp1, 2),
        "ratio_tp2_vs_tp1_multiproc": round(tp2 / mp1, 2),
        "ratio_tp1_multiproc_vs_inprocess": round(mp1 / tp1, 2),
        "identical_outputs_all_three": all_three,
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "batch_rows": args.prompts,  # a decode step's rows
        "hidden_size": model_config["hidden_size"],
        "reductions_per_step": 2 * model_config["num_hidden_layers"],
    }
