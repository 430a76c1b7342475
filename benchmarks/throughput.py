"""Throughput: kvstep ``LLM`` vs transformers ``generate()`` on the same random Llama.

    python benchmarks/throughput.py [--prompts 16] [--prompt-len 256] [--new-tokens 64]

Both run from this command, each in a fresh process of its own, on the same checkpoint,
dtype and prompts (greedy), each once untimed and then ``--repeats`` times (the best run
counts); the table
gives generated tokens/s of each and the ratio, and JSON goes to
``benchmarks/results/throughput.json``.
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

import torch
from _models import save_random_llama
from _results import RESULTS, save

from pipeline import LLM, EngineConfig, SamplingParams


def build_model(path: Path, seed: int = 0) -> int:
    """A ~30M-parameter random Llama saved with save_pretrained; returns its size."""
    return save_random_llama(
        path,
        seed,
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def run_transformers(
    path: Path, prompts: torch.Tensor, new_tokens: int, repeats: int
) -> tuple[float, list]:
    """Best of ``repeats`` timed runs after one untimed run of the same workload."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            if i:
                times.append(time.perf_counter() - start)
    return min(times), out[:, prompts.shape[1] :].tolist()


def run_kvstep(
    path: Path, prompts: torch.Tensor, new_tokens: int, repeats: int
) -> tuple[float, list]:
    """Best of ``repeats`` timed runs after one untimed run of the same workload."""
    config = EngineConfig(
        model=str(path),
        dtype="float32",
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
    run = run_transformers if engine == "transformers" else run_kvstep
    return run(path, prompts, args.new_tokens, args.repeats)


def _in_subprocess(engine: str, path: Path, args: argparse.Namespace) -> tuple[float, list]:
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
            "--json",
            str(out),
        ]
        subprocess.run(cmd, check=True)
        data = json.loads(out.read_text())
    return data["seconds"], data["tokens"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument("--json", type=Path, default=RESULTS / "throughput.json")
    parser.add_argument("--engine", choices=["both", "kvstep", "transformers"], default="both")
    parser.add_argument("--model-path", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.engine != "both":  # a child process of the run below
        seconds, tokens = _run_one(args.engine, args.model_path, args)
        args.json.write_text(json.dumps({"seconds": seconds, "tokens": tokens}))
        return {"seconds": seconds}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        params = build_model(path)
        hf_s, hf_tokens = _in_subprocess("transformers", path, args)
        kv_s, kv_tokens = _in_subprocess("kvstep", path, args)

    total = args.prompts * args.new_tokens
    agree = sum(a == b for a, b in zip(hf_tokens, kv_tokens, strict=True)) / len(hf_tokens)
    result = {
        "model_parameters": params,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "transformers_s": hf_s,
        "kvstep_s": kv_s,
        "transformers_tok_s": total / hf_s,
        "kvstep_tok_s": total / kv_s,
        "ratio": hf_s / kv_s,
        "identical_outputs_fraction": agree,
    }
    print(f"{'engine':<14}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'transformers':<14}{hf_s:>10.2f}{result['transformers_tok_s']:>12.1f}")
    print(f"{'kvstep':<14}{kv_s:>10.2f}{result['kvstep_tok_s']:>12.1f}")
    print(
        f"ratio kvstep/transformers: {result['ratio']:.2f}x  "
        f"(identical greedy outputs: {agree:.0%} of requests)"
    )
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
