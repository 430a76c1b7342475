"""Throughput: kvstep ``LLM`` vs transformers ``generate()`` on the same random Llama.

    python benchmarks/throughput.py [--prompts 16] [--prompt-len 256] [--new-tokens 64]
        [--dtypes float32 bfloat16] [--torch-compile]
    python benchmarks/throughput.py --serving [--num-requests 64] [--request-rate 1]
        [--batch 16] [--scenarios poisson saturation]

Both run from this command, each in a fresh process of its own, on the same checkpoint,
dtype and prompts (greedy, EOS not special), each once untimed and then ``--repeats``
times (the best run counts). For each of ``--dtypes`` the table gives generated tokens/s
of each engine and their ratio; with several dtypes it also gives kvstep's speed-up over
its own run in the first dtype. JSON goes to ``benchmarks/results/throughput.json``.

``--serving`` compares them as servers instead: arrivals over time, mixed lengths, shared
prefixes, kvstep's ``AsyncEngine`` against a static-batch ``generate()`` loop, reporting
throughput and TTFT/ITL p50/p99 (see ``_throughput_serving.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _throughput_serving as serving
import torch
from _models import save_random_llama
from _results import RESULTS, save

from pipeline import LLM, EngineConfig, SamplingParams


def build_model(path: Path, seed: int = 0, vocab_size: int = 8192) -> int:
    """A ~30M-parameter random Llama saved with save_pretrained; returns its size."""
    return save_random_llama(
        path,
        seed,
        vocab_size=vocab_size,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_transformers(
    path: Path, prompts: torch.Tensor, new_tokens: int, repeats: int, dtype: str
) -> tuple[float, list]:
    """Best of ``repeats`` timed runs after one untimed run of the same workload."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    # As kvstep's ignore_eos: EOS is an ordinary token (min_new_tokens would mask it out).
    model.generation_config.eos_token_id = None
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            if i:
                times.append(time.perf_counter() - start)
    return min(times), out[:, prompts.shape[1] :].tolist()


def run_kvstep(
    path: Path,
    prompts: torch.Tensor,
    new_tokens: int,
    repeats: int,
    dtype: str,
    torch_compile: bool = False,
) -> tuple[float, list]:
    """Best of ``repeats`` timed runs after one untimed run of the same workload
    (``torch_compile``: ``EngineConfig.torch_compile``, compiled before the untimed run)."""
    config = EngineConfig(
        torch_compile=torch_compile,
        model=str(path),
        dtype=dtype,
        max_num_batched_tokens=prompts.numel(),
        max_num_seqs=prompts.shape[0],
        max_model_len=prompts.shape[1] + new_tokens + 16,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    times = []
    with LLM(config) as llm:
        for i in range(repeats + 1):
            start = time.perf_counter()
            outs = llm.generate(prompts.tolist(), params)
            if i:
                times.append(time.perf_counter() - start)
    return min(times), [list(o.token_ids) for o in outs]


def _run_one(engine: str, path: Path, args: argparse.Namespace) -> tuple[float, list]:
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 8192, (args.prompts, args.prompt_len), generator=gen)
    if engine == "transformers":
        return run_transformers(path, prompts, args.new_tokens, args.repeats, args.dtypes[0])
    compiled = getattr(args, "torch_compile", False)
    return run_kvstep(path, prompts, args.new_tokens, args.repeats, args.dtypes[0], compiled)


def _in_subprocess(
    engine: str, path: Path, args: argparse.Namespace, dtype: str
) -> tuple[float, list]:
    """Each engine runs in a fresh process: torch work on one thread leaves state that
    slows torch work on another thread of the same process (seen here: kvstep run after
    transformers in one process took 3.72 s, 2.85 s before it), so neither goes second."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--model-path",
            str(path),
            "--prompts",
            str(args.prompts),
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--repeats",
            str(args.repeats),
            "--dtypes",
            dtype,
            "--json",
            str(out),
        ]
        if getattr(args, "torch_compile", False):
            cmd.append("--torch-compile")
        subprocess.run(cmd, check=True)
        data = json.loads(out.read_text())
    return data["seconds"], data["tokens"]


def _compare(path: Path, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """Both engines in ``dtype``: seconds, tokens/s, ratio and greedy agreement."""
    hf_s, hf_tokens = _in_subprocess("transformers", path, args, dtype)
    kv_s, kv_tokens = _in_subprocess("kvstep", path, args, dtype)
    total = args.prompts * args.new_tokens
    agree = sum(a == b for a, b in zip(hf_tokens, kv_tokens, strict=True)) / len(hf_tokens)
    return {
        "dtype": dtype,
        "transformers_s": hf_s,
        "kvstep_s": kv_s,
        "transformers_tok_s": total / hf_s,
        "kvstep_tok_s": total / kv_s,
        "ratio": hf_s / kv_s,
        "identical_outputs_fraction": agree,
    }


def _print_table(runs: list[dict[str, Any]]) -> None:
    print(f"{'dtype':<10}{'engine':<14}{'seconds':>10}{'tokens/s':>12}")
    for run in runs:
        for engine in ("transformers", "kvstep"):
            row = f"{run['dtype']:<10}{engine:<14}{run[engine + '_s']:>10.2f}"
            print(f"{row}{run[engine + '_tok_s']:>12.1f}")
        print(
            f"{run['dtype']}: kvstep/transformers {run['ratio']:.2f}x  "
            f"(identical greedy outputs: {run['identical_outputs_fraction']:.0%} of requests)"
        )
    base = runs[0]
    for run in runs[1:]:
        speedup = run["kvstep_tok_s"] / base["kvstep_tok_s"]
        print(f"kvstep {run['dtype']} vs kvstep {base['dtype']}: {speedup:.2f}x")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=list(DTYPES), default=["float32"], help="each is run"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "throughput.json")
    parser.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="kvstep with EngineConfig.torch_compile (compiled at load, outside the timing)",
    )
    parser.add_argument(
        "--engine",
        choices=["both", "kvstep", "transformers", *(e for e, _ in serving.VARIANTS.values())],
        default="both",
    )
    parser.add_argument("--model-path", type=Path, default=None, help=argparse.SUPPRESS)
    serving.add_arguments(parser)
    args = parser.parse_args(argv)

    if args.serving and args.engine != "both":
        return serving.child(args)
    if args.serving:
        return serving.compare(args, sys.argv[1:] if argv is None else argv, __file__, build_model)

    if args.engine != "both":  # a child process of the run below
        seconds, tokens = _run_one(args.engine, args.model_path, args)
        args.json.write_text(json.dumps({"seconds": seconds, "tokens": tokens}))
        return {"seconds": seconds}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        params = build_model(path)
        runs = [_compare(path, args, dtype) for dtype in args.dtypes]

    result = {
        "model_parameters": params,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "repeats": args.repeats,
        "torch_compile": args.torch_compile,
        "runs": runs,
        "kvstep_speedup_vs_first_dtype": {
            run["dtype"]: run["kvstep_tok_s"] / runs[0]["kvstep_tok_s"] for run in runs[1:]
        },
    }
    _print_table(runs)
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
