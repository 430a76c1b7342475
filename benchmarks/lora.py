"""What a batch of mixed LoRA adapters costs against a base-only batch (issue 29).

    python benchmarks/lora.py [--model PATH|builtin:tiny] [--batch 8] [--adapters 4]
        [--rank 16] [--prompt-len 128] [--new-tokens 64] [--rounds 2] [--json PATH]

On one model (default: the throughput benchmark's random ~32M Llama) and ``--adapters``
random adapters of rank ``--rank`` on all seven projections (written as peft saves them),
the same ``--batch`` prompts, greedy, EOS ignored, run as:

* **base** on an engine without LoRA (the baseline);
* **base, LoRA on**: the same base-only batch on an engine with ``enable_lora`` (what
  the wrapped projections cost when no row has an adapter);
* **one adapter**: every row on one adapter;
* **mixed**: the rows spread over base and every adapter, round robin
  (``max_loras`` = ``--adapters``).

Each engine is loaded one at a time in this process (a second engine's threads would
slow the first), warmed up untimed, then best of ``--rounds``. Prints generated tokens/s
of each and its ratio to the baseline; JSON: ``benchmarks/results/lora.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _results import RESULTS, cpu, save
from safetensors.torch import save_file
from throughput import build_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, model: Path, rank: int, seed: int) -> Path:
    """A random peft LoRA adapter of ``model`` on every projection (peft's file layout)."""
    from stages.model.config import load_model_config
    from stages.model.lora_files import lora_shapes

    config = load_model_config(model)
    shapes = lora_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in TARGETS:
            fan_in, fan_out = shapes[target]
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": list(TARGETS), "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def run(
    model: str, prompts: list[list[int]], loras: list[Any], args: argparse.Namespace, **config: Any
) -> dict[str, Any]:
    """Best generated tokens/s of ``prompts`` (each with its adapter) on one engine."""
    from pipeline import LLM, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    tokens: list[tuple[int, ...]] = []
    engine = EngineConfig(model=model, dtype="float32", max_num_seqs=len(prompts), **config)
    with LLM(engine) as llm:
        llm.generate(prompts, params, lora_request=loras)  # warm-up, untimed
        for _ in range(args.rounds):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras)
            elapsed = time.perf_counter() - start
            best = max(best, sum(len(o.token_ids) for o in outs) / elapsed)
            tokens = [tuple(o.token_ids) for o in outs]
    return {"tokens_per_s": best, "tokens": tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from pipeline import LoRARequest

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: a random ~32M Llama")
    parser.add_argument("--vocab", type=int, default=8192, help="prompt token ids below it")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "lora.json")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(Path(tmp) / "llama")
        if args.model is None:
            build_model(Path(model), vocab_size=args.vocab)
        from stages.model.builtin import resolve_model_path

        base_dir = Path(resolve_model_path(model))
        adapters = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", base_dir,
                                                            args.rank, i)))
            for i in range(args.adapters)
        ]  # fmt: skip
        lora = {"enable_lora": True, "max_loras": args.adapters, "max_lora_rank": args.rank}
        spread = [None, *adapters]
        mixed = [spread[i % len(spread)] for i in range(args.batch)]
        rows = {
            "base": run(model, prompts, [None] * args.batch, args),
            "base, LoRA on": run(model, prompts, [None] * args.batch, args, **lora),
            "one adapter": run(model, prompts, [adapters[0]] * args.batch, args, **lora),
            "mixed": run(model, prompts, mixed, args, **lora),
        }
    baseline = rows["base"]["tokens_per_s"]
    results = [{"workload": name, "tokens_per_s": round(row["tokens_per_s"], 1),
                "ratio": round(row["tokens_per_s"] / baseline, 3)}
               for name, row in rows.items()]  # fmt: skip
    same_base = rows["base"]["tokens"] == rows["base, LoRA on"]["tokens"]
    shape = f"{args.adapters} adapters of rank {args.rank} on every projection"
    print(f"CPU: {cpu()}; batch {args.batch}, {shape}, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens")  # fmt: skip
    print(f"{'workload':<16}{'tok/s':>10}{'vs base':>10}")
    for row in results:
        print(f"{row['workload']:<16}{row['tokens_per_s']:>10.1f}{row['ratio']:>9.2f}x")
    print(f"base rows' tokens unchanged with LoRA on: {same_base}")
    result = {"cpu": cpu(), "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "base_tokens_unchanged": same_base,
              "results": results}  # fmt: skip
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
