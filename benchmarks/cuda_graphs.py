"""Decode steps from CUDA graphs against the eager forward pass, on one GPU.

One process, one random Llama saved with ``save_pretrained`` (``--layers`` layers of
``--hidden`` width, vocab 32,000), two in-process engines on ``cuda`` that differ only
in ``EngineConfig.cuda_graphs``. For each batch size, ``batch`` greedy requests
(``ignore_eos``) of ``--tokens`` tokens each are submitted together; the time from the
first token of the last request to the end is decode-only steps, reported as ms per
step and output tokens per second. Rounds alternate the two engines. The tokens of
both engines are compared request by request (the graphs' padded attention agrees with
the eager path to rounding, so a token may differ where two logits nearly tie).

Needs CUDA: without it, it says so, measures nothing and writes ``{"skipped": ...}``.

    python benchmarks/cuda_graphs.py [--batches 1 8 32] [--tokens N] [--rounds N]
        [--layers N] [--hidden N] [--dtype float32|bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import anyio
import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _models import save_random_llama
from _results import save

DEFAULT_JSON = Path(__file__).parent / "results" / "cuda_graphs.json"


async def _decode(engine: Any, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Ms per decode-only step of ``batch`` requests, and their tokens."""
    from pipeline import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    first_at: dict[int, int] = {}  # request -> when its first token came
    outputs: list[list[int]] = [[] for _ in range(batch)]

    async def one(i: int) -> None:
        prompt = [1 + (7 * i + j) % 997 for j in range(16 + i % 5)]
        async for out in engine.generate(prompt, params):
            first_at.setdefault(i, perf_counter_ns())
            outputs[i] = list(out.token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(batch):
            tg.start_soon(one, i)
    end = perf_counter_ns()
    steps = tokens - 1  # after every request's first token, one step a token
    return (end - max(first_at.values())) / steps / 1e6, outputs


async def _measure(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from pipeline import AsyncEngine, EngineConfig

    eager_config = EngineConfig(
        model=str(path), device="cuda", dtype=args.dtype, max_num_seqs=max(args.batches),
        max_model_len=1024, enable_prefix_caching=False,
    )  # fmt: skip
    graphs_config = attrs.evolve(eager_config, cuda_graphs=True)
    rows = []
    async with AsyncEngine(eager_config) as eager, AsyncEngine(graphs_config) as graphs:
        for batch in args.batches:
            for warm in (eager, graphs):  # loads kernels, captures the shapes
                await _decode(warm, batch, args.tokens)
            samples: dict[str, list[float]] = {"eager": [], "graphs": []}
            same = total = 0
            for _ in range(args.rounds):
                ms_eager, out_eager = await _decode(eager, batch, args.tokens)
                ms_graphs, out_graphs = await _decode(graphs, batch, args.tokens)
                samples["eager"].append(ms_eager)
                samples["graphs"].append(ms_graphs)
                same += sum(a == b for a, b in zip(out_eager, out_graphs, strict=True))
                total += batch
            ms = {k: statistics.median(v) for k, v in samples.items()}
            rows.append({
                "batch": batch,
                "eager_ms_per_step": round(ms["eager"], 4),
                "graphs_ms_per_step": round(ms["graphs"], 4),
                "eager_tok_s": round(batch * 1e3 / ms["eager"], 1),
                "graphs_tok_s": round(batch * 1e3 / ms["graphs"], 1),
                "speedup": round(ms["eager"] / ms["graphs"], 3),
                "identical_requests": f"{same}/{total}",
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.tokens < 2 or args.rounds < 1:
        parser.error("--batches must be >= 1, --tokens >= 2 and --rounds >= 1")
    result: dict[str, Any] = {"benchmark": "cuda_graphs", "dtype": args.dtype}
    if not torch.cuda.is_available():
        result["skipped"] = "needs a CUDA device; nothing was measured"
        print(result["skipped"])
        save(args.json, result)
        return result
    model = dict(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=1024,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        params = save_random_llama(Path(tmp), **model)
        rows = anyio.run(_measure, Path(tmp), args)
    result.update(device=torch.cuda.get_device_name(), model={**model, "parameters": params},
                  tokens=args.tokens, rounds=args.rounds, results=rows)  # fmt: skip
    print(f"\nDecode steps on {result['device']}, {params / 1e6:.0f}M Llama, {args.dtype}")
    print(f"  {'batch':>5} {'eager ms':>9} {'graphs ms':>10} {'speedup':>8} {'same':>7}")
    for r in rows:
        print(f"  {r['batch']:>5} {r['eager_ms_per_step']:9.3f} {r['graphs_ms_per_step']:10.3f} "
              f"{r['speedup']:7.2f}x {r['identical_requests']:>7}")  # fmt: skip
    save(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
