"""Mixture of experts: kvstep ``LLM`` vs transformers ``generate()`` on one random Mixtral.

    python benchmarks/moe.py [--prompts 8] [--prompt-len 128] [--new-tokens 32]
        [--dtypes float32 bfloat16] [--experts 8] [--top-k 2]

Issue 29's MoE row: a random ``MixtralForCausalLM`` (4 layers, hidden 512, GQA 8/4,
``--experts`` experts of intermediate width 704, ``--top-k`` per token, ~40M parameters
with 8 experts) saved once, then the throughput benchmark's comparison on it
(:mod:`throughput`: each engine in a fresh process of its own, the same prompts, greedy,
EOS not special, best of ``--repeats`` after an untimed run): generated tokens/s of each,
their ratio (goal: kvstep >= 1.0x transformers) and how many requests' greedy tokens
agree. JSON: ``benchmarks/results/moe.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _models import save_random_mixtral
from _results import RESULTS, cpu, save
from throughput import DTYPES, _compare, _print_table

GOAL = 1.0


def build_moe(path: Path, experts: int, top_k: int) -> int:
    """The random Mixtral this benchmark runs; returns its parameter count."""
    return save_random_mixtral(
        path,
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=2048,
        sliding_window=None,
        tie_word_embeddings=False,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "moe.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mixtral"
        params = build_moe(path, args.experts, args.top_k)
        runs = [_compare(path, args, dtype) for dtype in args.dtypes]
    print(f"CPU: {cpu()}; random Mixtral, {params / 1e6:.0f}M parameters, "
          f"{args.experts} experts, top {args.top_k}")  # fmt: skip
    _print_table(runs)
    result = {"cpu": cpu(), "model_parameters": params, "experts": args.experts,
              "top_k": args.top_k, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "goal_ratio": GOAL, "runs": runs}  # fmt: skip
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
