"""A batch-1 decode step on a tiny model: kvstep against transformers (issue 15).

One process, fp32, ``torch.set_num_threads(1)`` for every contender (kvstep's compute
thread and transformers' loop alike), on one random 1-layer Llama (vocab 1,000, hidden
size ``HIDDEN``) saved with ``save_pretrained``:

* ``kvstep`` (``async_scheduling=True``): one request decoding ``tokens`` tokens
  through ``AsyncEngine`` (greedy, ``ignore_eos``); the median gap between consecutive
  outputs of the stream, i.e. the steady-state inter-token latency, which is one whole
  engine step (schedule, execute, worker graph, forward, sample, fan-in, update,
  publish) per token;
* ``bare``: ``model(input_ids, past_key_values=cache)`` of one token in a loop, the
  next token by ``argmax`` of the logits (the least a decode step must do);
* ``generate``: ``model.generate(max_new_tokens=tokens)`` per generated token;
* ``kvstep`` in series: the same engine with ``async_scheduling=False`` (the default:
  each step planned after the previous one is applied), and the default
  ``inline_forward_below_s``: a pass whose shape's recent passes took under 2 ms runs on
  the event loop's thread;
* ``kvstep`` handed over: in series with ``inline_forward_below_s=0``: every forward
  pass and its sampling handed to the compute thread and back (two thread wake-ups);
* ``kvstep`` inline: in series with ``inline_forward=True``: every forward pass and its
  sampling on the event loop's thread;
* ``kvstep`` + no-op logits stage: the async-scheduling engine with a user's
  :class:`~pipeline.LogitsStage` that returns its logits unchanged inserted after
  ``logits`` (issue 25: the seam's price; goal <= 1.05x the plain async engine).

Rounds alternate the contenders so that they share any drift of a shared machine. The
per-stage medians of kvstep's engine and worker steps come from the step log's
listener (``StepLog.listeners``): where a step's time goes. Goal: kvstep <= 1.15x bare.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import anyio
import attrs
import torch
from _models import save_random_llama

HIDDEN = 64
MODEL = dict(
    vocab_size=1000,
    hidden_size=HIDDEN,
    intermediate_size=4 * HIDDEN,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11]
GOAL_RATIO = 1.15
GOAL_SEAM_RATIO = 1.05


def _noop_graph(graph: Any) -> Any:
    """The default worker graph with a no-op logits stage after ``logits``."""
    from typing import ClassVar

    from pipeline import LogitsStage

    @attrs.frozen
    class NoopLogits(LogitsStage):
        name: ClassVar[str] = "noop_logits"

        def apply(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
            return logits

    return graph.insert_after("logits", NoopLogits())


def _bare_ms(model: Any, tokens: int) -> float:
    """Median ms of one decode forward with a KV cache (after the prompt's prefill)."""
    import transformers

    cache = transformers.DynamicCache()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values, renamed in 5.x
        out = model(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        samples = []
        for _ in range(tokens):
            t0 = perf_counter_ns()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            samples.append(perf_counter_ns() - t0)
    return statistics.median(samples[tokens // 10 :]) / 1e6


def _generate_ms(model: Any, tokens: int) -> float:
    """Wall ms of ``generate(max_new_tokens=tokens)`` (greedy) per generated token."""
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        t0 = perf_counter_ns()
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
        elapsed = perf_counter_ns() - t0
    return elapsed / (out.shape[1] - len(PROMPT)) / 1e6


async def _kvstep_ms(engine: Any, tokens: int) -> float:
    """Median ms between consecutive outputs of one request's stream (steady state)."""
    from pipeline import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    stamps = []
    async for _ in engine.generate(PROMPT, params):
        stamps.append(perf_counter_ns())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(gaps[len(gaps) // 10 :]) / 1e6


def _stage_listener(sink: dict[str, list[float]]) -> Any:
    def listen(report: Any, kind: str, fields: dict[str, Any]) -> None:
        sink[f"{kind} step"].append(report.duration_s)
        for s in report.stages:
            sink[f"{kind}.{s.name}"].append(s.duration_s)

    return listen


async def _measure_async(path: Path, tokens: int, rounds: int) -> dict[str, Any]:
    import transformers

    from pipeline import AsyncEngine, EngineConfig

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    in_series = EngineConfig(model=str(path), dtype="float32", max_model_len=4096)
    # kvstep's contenders: sample key -> (its step log's per-stage key, its config).
    contenders = {
        "kvstep": ("stages_us", attrs.evolve(in_series, async_scheduling=True)),
        "kvstep_noop": ("stages_noop_us", attrs.evolve(in_series, async_scheduling=True)),
        "kvstep_sync": ("stages_in_series_us", in_series),
        "kvstep_handed": ("stages_handed_us", attrs.evolve(in_series, inline_forward_below_s=0.0)),
        "kvstep_inline": ("stages_inline_us", attrs.evolve(in_series, inline_forward=True)),
    }
    stages: dict[str, dict[str, list[float]]] = {
        key: defaultdict(list) for key, _ in contenders.values()
    }
    samples: dict[str, list[float]] = {name: [] for name in (*contenders, "bare", "generate")}
    async with contextlib.AsyncExitStack() as stack:
        engines = {
            name: await stack.enter_async_context(
                AsyncEngine(config, worker_graph=_noop_graph if name == "kvstep_noop" else None)
            )
            for name, (_, config) in contenders.items()
        }
        for engine in engines.values():
            await _kvstep_ms(engine, 32)
        _bare_ms(model, 32)
        for name, engine in engines.items():
            engine.core.step_log.listeners.append(_stage_listener(stages[contenders[name][0]]))
        for _ in range(rounds):
            for name, engine in engines.items():
                samples[name].append(await _kvstep_ms(engine, tokens))
            samples["bare"].append(_bare_ms(model, tokens))
            samples["generate"].append(_generate_ms(model, tokens))
    ms = {k: statistics.median(v) for k, v in samples.items()}
    return {
        **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
        **{f"ratio_{k}_bare": round(ms[k] / ms["bare"], 3) for k in (*contenders, "generate")},
        "ratio_kvstep_noop_kvstep": round(ms["kvstep_noop"] / ms["kvstep"], 3),
        **{
            key: {k: round(statistics.median(v) * 1e6, 1) for k, v in per_stage.items()}
            for key, per_stage in stages.items()
        },
    }


def measure_decode_step(
    tokens: int = 300, rounds: int = 5, backend: str = "asyncio"
) -> dict[str, Any]:
    """Build the model, run every contender in alternating rounds; ms per token each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            params = save_random_llama(Path(tmp), **MODEL)
            row = anyio.run(_measure_async, Path(tmp), tokens, rounds, backend=backend)
    finally:
        torch.set_num_threads(threads)
    return {"model": {**MODEL, "parameters": params}, "threads": 1, "dtype": "float32",
            "backend": backend, "tokens": tokens, "rounds": rounds, "goal_ratio": GOAL_RATIO,
            "goal_seam_ratio": GOAL_SEAM_RATIO,
            **row}  # fmt: skip


def print_decode_step(row: dict[str, Any]) -> None:
    m = row["model"]
    print(
        f"\nBatch-1 decode step (1 layer, vocab {m['vocab_size']}, hidden {m['hidden_size']}, "
        f"fp32, 1 thread, {row['tokens']} tokens x {row['rounds']} rounds)"
    )
    print(f"  {'contender':<34} {'ms/token':>9} {'vs bare':>8}")
    for label, key, ratio in (
        ("kvstep, async scheduling", "kvstep_ms", "ratio_kvstep_bare"),
        ("kvstep, async + no-op logits stage", "kvstep_noop_ms", "ratio_kvstep_noop_bare"),
        ("kvstep, in series (default)", "kvstep_sync_ms", "ratio_kvstep_sync_bare"),
        ("kvstep, in series, handed over", "kvstep_handed_ms", "ratio_kvstep_handed_bare"),
        ("kvstep, in series, inline_forward", "kvstep_inline_ms", "ratio_kvstep_inline_bare"),
        ("transformers bare forward", "bare_ms", None),
        ("transformers generate()", "generate_ms", "ratio_generate_bare"),
    ):
        times = f"{row[ratio]:.2f}x" if ratio else "1.00x"
        print(f"  {label:<34} {row[key]:9.3f} {times:>8}")
    print(
        f"  no-op logits stage / plain: {row['ratio_kvstep_noop_kvstep']:.3f}x "
        f"(goal <= {row['goal_seam_ratio']}x)"
    )
    print(f"  goal: kvstep/bare <= {row['goal_ratio']}x; per-stage medians (µs):")
    print(f"    {'stage':<24} {'async':>8} {'in series':>10} {'handed':>8} {'inline':>8}")
    noop = row["stages_noop_us"]
    for name in [n for n in noop if n not in row["stages_in_series_us"]]:
        print(f"    {name:<24} {noop[name]:8.1f} (async + no-op stage)")
    for name, us in row["stages_in_series_us"].items():
        asy = row["stages_us"].get(name, float("nan"))
        hand = row["stages_handed_us"].get(name, float("nan"))
        inl = row["stages_inline_us"].get(name, float("nan"))
        print(f"    {name:<24} {asy:8.1f} {us:10.1f} {hand:8.1f} {inl:8.1f}")


if __name__ == "__main__":
    print_decode_step(measure_decode_step())
