"""The decode step with the decode KV mirror on and off (issue 27).

Two runners of one random Llama (hidden 512, 8 heads, 4 KV heads, head_dim 64, 4 layers),
one with ``decode_mirror`` and one without, prefill the same ``batch`` requests (contexts
350-520), then run decode-only steps, alternating on and off in rounds so that both share
a shared machine's drift. Prints the best and median step time of each and the ratio.

    python benchmarks/decode_mirror.py [--dtype bfloat16] [--batch 64] [--rounds 6]

AMX Xeon, 2 shared cores, 4 rounds of 4 steps, best (median) on/off: bfloat16 batch 64
0.93 (0.95), 8 0.86 (0.90), 1 0.99 (0.99); float32 batch 64 0.36 (0.34), 8 0.76 (0.83),
1 0.95 (0.95).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path
from time import perf_counter

import torch
from _models import save_random_llama

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="decode steps per round")
    args = parser.parse_args()
    rng = random.Random(0)
    n = args.batch
    ctx = [rng.randrange(350, 520) for _ in range(n)]
    per = -(-(max(ctx) + args.rounds * args.steps * 2 + 1) // BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_random_llama(path, **MODEL)
        common = dict(device="cpu", dtype=args.dtype, num_blocks=n * per + 1,
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
    print(f"{args.dtype} batch {n} threads {torch.get_num_threads()}: "
          f"off best {best['off']:.2f} ms median {med['off']:.2f} | "
          f"on best {best['on']:.2f} ms median {med['on']:.2f} | "
          f"on/off best {best['on'] / best['off']:.2f} "
          f"median {med['on'] / med['off']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
