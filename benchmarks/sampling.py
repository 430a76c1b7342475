"""Drawing tokens from a batch of logits: kvstep's sampler against the exponential race.

    python benchmarks/sampling.py [--vocabs 32000 152064] [--batches 1 8 32]
        [--repeats 20] [--json PATH]

For each vocabulary size, batch size and sampling setting (temperature 1; temperature
0.7 with top_p 0.9; top_k 50), times :meth:`stages.model.Sampler.sample_rows` on logits
shaped as a language model's (a few tokens hold most of the mass), against the baseline
in the same run: the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``, one draw per
vocabulary entry) after a full sort for top-k/top-p, which is what kvstep did before
and what vLLM's CPU sampler does. Alternates the two each repeat; prints the median
time of each and baseline/kvstep (above 1: kvstep faster); JSON:
``benchmarks/results/sampling.json``. Also checks that every token kvstep drew is one
the baseline's rule keeps (top-k/top-p).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _results import RESULTS, cpu, save

from pipeline.config import SamplingParams
from stages.model import Sampler

SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "t 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
}


def kept(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The baseline's logits after top-k/top-p: a full sort per row (``-inf`` outside)."""
    vocab = logits.shape[-1]
    x = logits / p.temperature
    if not (0 < p.top_k < vocab or p.top_p < 1.0):
        return x
    x, order = x.sort(dim=-1, descending=True)
    if 0 < p.top_k < vocab:
        x[:, p.top_k :] = float("-inf")
    if p.top_p < 1.0:
        probs = x.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= p.top_p
        drop[:, 0] = False
        x = x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(1, order, x)


def exponential_race(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> list[int]:
    probs = kept(logits, p).softmax(dim=-1)
    q = torch.empty_like(probs).exponential_(generator=gen)
    return (probs / q).argmax(dim=-1).tolist()  # type: ignore[no-any-return]


def _seconds(fn: Callable[[], object]) -> float:
    start = perf_counter()
    fn()
    return perf_counter() - start


def measure(vocab: int, batch: int, name: str, repeats: int) -> dict[str, Any]:
    p = SETTINGS[name]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    sampler, gen = Sampler(seed=0, device=torch.device("cpu")), torch.Generator()
    params, indices = [p] * batch, [0] * batch
    ours = lambda: sampler.sample_rows(logits, params, indices, adjust=False)  # noqa: E731
    theirs = lambda: exponential_race(logits, p, gen)  # noqa: E731
    allowed = kept(logits, p).isfinite()
    for _ in range(2):  # warm-up; every token drawn is one the rule keeps
        tokens = ours().tokens
        assert all(allowed[i, t] for i, t in enumerate(tokens)), (vocab, batch, name)
        theirs()
    t_ours, t_base = [], []
    for r in range(repeats):
        pair = [(t_ours, ours), (t_base, theirs)]
        for sink, fn in pair if r % 2 == 0 else pair[::-1]:
            sink.append(_seconds(fn))
    ours_ms, base_ms = statistics.median(t_ours) * 1e3, statistics.median(t_base) * 1e3
    return {"vocab": vocab, "batch": batch, "setting": name, "kvstep_ms": round(ours_ms, 3),
            "baseline_ms": round(base_ms, 3), "speedup": round(base_ms / ours_ms, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocabs", nargs="+", type=int, default=[32000, 152064])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=RESULTS / "sampling.json")
    args = parser.parse_args(argv)
    rows = [measure(v, b, name, args.repeats)
            for v in args.vocabs for b in args.batches for name in SETTINGS]  # fmt: skip
    print(f"CPU: {cpu()}; {torch.get_num_threads()} threads; median ms per batch")
    print(f"{'vocab':>7}{'batch':>6}  {'setting':<18}{'kvstep':>9}{'baseline':>10}{'speedup':>9}")
    for r in rows:
        print(f"{r['vocab']:>7}{r['batch']:>6}  {r['setting']:<18}{r['kvstep_ms']:>9.3f}"
              f"{r['baseline_ms']:>10.3f}{r['speedup']:>8.2f}x")  # fmt: skip
    result = {"cpu": cpu(), "threads": torch.get_num_threads(), "repeats": args.repeats,
              "results": rows}  # fmt: skip
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
