"""Roofline: this machine's GEMM peak and memory bandwidth against the model's work.

    python benchmarks/roofline.py [--prefill-tokens 4096] [--prefill-seq-len 512]
        [--decode-tokens 32] [--dtype float32] [--torch-compile]

Measures the fp32 and bf16 GEMM peak of each linear kernel kvstep can choose
(:mod:`stages.model.linear_kernels`: ``mkl``, square ``torch.mm(a, b.t())``, the layout of
``nn.Linear``, and ``onednn``, the same product with ``b`` prepacked; utilisation is
against the best of them; on an AVX2-only CPU ``a @ b`` in bf16 takes a naive path ~10x
slower still; the size stops growing once one call takes over a second, so a machine
without fast bf16 arithmetic still finishes)
and the memory read bandwidth (``sum`` over a buffer far above the last-level cache).
It counts the FLOPs and bytes per token of the throughput benchmark's ~30M Llama (its
fp32 weights, ~120 MB, and bf16 weights exceed a 32 MiB L3), then times, for kvstep
and transformers (each in a fresh process): one prefill step of ``--prefill-tokens``
(sequences of ``--prefill-seq-len``), as FLOP/s against the GEMM peak, and batch-1
decode, as ms/token against the weight-streaming bound (weight bytes / bandwidth).
It also times torch's own batch-1 ``F.linear`` over matrices of the model's weight
shapes (the decode step's matmuls and nothing else): the floor of any engine built on
torch's CPU kernels, which may lie far above the bound.
JSON goes to ``benchmarks/results/roofline.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, save
from throughput import DTYPES, build_model

from pipeline import LLM, EngineConfig, SamplingParams
from stages.model.linear_kernels import available_kernels


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _gemm(kernel: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    """``a @ b.T`` on ``kernel`` (see :mod:`stages.model.linear_kernels`): ``"mkl"`` is
    ``torch.mm`` (what ``F.linear`` calls), ``"onednn"`` oneDNN with ``b`` prepacked."""
    if kernel == "mkl":
        return functools.partial(torch.mm, a, b.t())
    packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
    return functools.partial(torch.ops.mkldnn._linear_pointwise, a, packed, None, "none", [], "")


def gemm_peak(
    dtype: torch.dtype, max_size: int, repeats: int, kernel: str = "mkl"
) -> dict[str, float]:
    """GFLOP/s of square ``a @ b.T`` on ``kernel``; the size doubles from 256 up to
    ``max_size`` while one call stays under a second (the largest size's rate is reported)."""
    size, rate = 256, 0.0
    while True:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        gemm = _gemm(kernel, a, b)
        with torch.inference_mode():
            start = time.perf_counter()
            gemm()
            once = time.perf_counter() - start
            seconds = _best(gemm, repeats) if once < 1.0 else once
        rate = 2 * size**3 / seconds / 1e9
        if size * 2 > max_size or once > 1.0:
            return {"size": size, "gflop_s": rate}
        size *= 2


def read_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of ``sum`` over a ``mib``-MiB float32 buffer (read once per call)."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / _best(lambda: x.sum(), repeats) / 1e9


def weight_shapes(path: Path) -> list[tuple[int, int]]:
    """``(out, in)`` of every matmul weight a decode token passes through (``lm_head`` last)."""
    cfg = json.loads((path / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden),
             (inter, hidden), (hidden, inter)]  # fmt: skip
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def gemv_floor(shapes: list[tuple[int, int]], dtype: torch.dtype, repeats: int) -> float:
    """Seconds of batch-1 ``F.linear`` over one weight of each shape (random values)."""
    weights = [torch.randn(shape).to(dtype) for shape in shapes]
    inputs = {n: torch.randn(1, n).to(dtype) for n in {w.shape[1] for w in weights}}

    def once() -> None:
        with torch.inference_mode():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

    return _best(once, max(repeats, 5))


def model_counts(path: Path, dtype: str, seq_len: int) -> dict[str, float]:
    """Weights and FLOPs of the checkpoint at ``path`` (from its config.json).

    ``linear_params`` are every matmul weight a token passes through (layers and
    ``lm_head``; the embedding is a lookup). Prefill FLOPs per token: ``2 *`` the
    layers' linear params plus causal attention ``4 * layers * q_width * (seq_len + 1)
    / 2``; ``lm_head`` adds ``2 * lm_head_params`` per sequence (only the last row's
    logits are needed). Decode streams ``linear_params`` weights per step.
    """
    cfg = json.loads((path / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_width = cfg["num_attention_heads"] * head_dim
    kv_width = cfg["num_key_value_heads"] * head_dim
    per_layer = hidden * (2 * q_width + 2 * kv_width) + 3 * hidden * inter
    lm_head = hidden * cfg["vocab_size"]
    linear = layers * per_layer + lm_head
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    attention = 4 * layers * q_width * (seq_len + 1) / 2
    return {
        "linear_params": linear,
        "weight_bytes": linear * elem,
        "lm_head_params": lm_head,
        "prefill_flops_per_token": 2 * (linear - lm_head) + attention,
    }


def time_kvstep(path: Path, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of one ``--prefill-tokens`` prefill step, and decode seconds per token."""
    n_seqs = args.prefill_tokens // args.prefill_seq_len
    config = EngineConfig(
        model=str(path),
        dtype=args.dtype,
        max_num_batched_tokens=args.prefill_tokens,
        max_num_seqs=n_seqs,
        max_model_len=args.prefill_seq_len + args.decode_tokens + 16,
        enable_prefix_caching=False,
        torch_compile=args.torch_compile,
    )
    prompts = _prompts(n_seqs, args.prefill_seq_len)

    def gen(batch: torch.Tensor, n: int) -> Callable[[], object]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return lambda: llm.generate(batch.tolist(), params)

    with LLM(config) as llm:
        prefill = _best(gen(prompts, 1), args.repeats)
        one = _best(gen(prompts[:1, :16], 1), args.repeats)
        many = _best(gen(prompts[:1, :16], args.decode_tokens + 1), args.repeats)
    return {"prefill_s": prefill, "decode_s_per_token": (many - one) / args.decode_tokens}


def time_transformers(path: Path, args: argparse.Namespace) -> dict[str, float]:
    """As :func:`time_kvstep`, with ``forward`` (last row's logits) and ``generate``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype])
    model = model.eval()
    model.generation_config.eos_token_id = None
    prompts = _prompts(args.prefill_tokens // args.prefill_seq_len, args.prefill_seq_len)
    one_prompt = prompts[:1, :16]

    def gen(n: int) -> Callable[[], object]:
        return lambda: model.generate(
            one_prompt,
            attention_mask=torch.ones_like(one_prompt),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        prefill = _best(lambda: model(prompts, logits_to_keep=1), args.repeats)
        one = _best(gen(1), args.repeats)
        many = _best(gen(args.decode_tokens + 1), args.repeats)
    return {"prefill_s": prefill, "decode_s_per_token": (many - one) / args.decode_tokens}


def _prompts(n: int, length: int) -> torch.Tensor:
    return torch.randint(1, 8192, (n, length), generator=torch.Generator().manual_seed(1))


def _in_subprocess(engine: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    """Each engine in a fresh process (see throughput.py for why)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--engine", engine, "--model-path", str(path)]
        for flag in ("prefill_tokens", "prefill_seq_len", "decode_tokens", "repeats", "dtype"):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        if args.torch_compile:
            cmd.append("--torch-compile")
        subprocess.run([*cmd, "--json", str(out)], check=True)
        result: dict[str, float] = json.loads(out.read_text())
    return result


def _report(result: dict[str, Any]) -> None:
    peak, bound = result["gemm_peak_gflop_s"], result["decode_bound_ms"]
    for name in ("float32", "bfloat16"):
        rates = ", ".join(
            f"{k} {v['gflop_s']:.1f}" for k, v in result[f"gemm_{name}_kernels"].items()
        )
        print(f"GEMM peak {name} (GFLOP/s): {rates} (cpu: {result['cpu_capability']})")
    print(
        f"read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s; weights "
        f"{result['weight_bytes'] / 1e6:.1f} MB ({result['dtype']}) -> bound {bound:.2f} ms/token"
    )
    print(
        f"torch's batch-1 F.linear over the same weights: {result['gemv_floor_ms']:.2f} ms "
        f"({result['gemv_gb_s']:.1f} GB/s), {result['gemv_floor_ms'] / bound:.2f}x the bound"
    )
    print(
        f"{'engine':<14}{'prefill s':>10}{'GFLOP/s':>9}{'of peak':>9}"
        f"{'decode ms':>11}{'x bound':>9}{'x F.linear':>11}"
    )
    for name in ("kvstep", "transformers"):
        r = result[name]
        print(
            f"{name:<14}{r['prefill_s']:>10.2f}{r['prefill_gflop_s']:>9.1f}"
            f"{r['prefill_peak_fraction']:>9.0%}{r['decode_ms']:>11.2f}{r['decode_x_bound']:>9.2f}"
            f"{r['decode_x_gemv_floor']:>11.2f}"
        )
    best = result[f"gemm_{result['dtype']}_kernel"]
    print(f"(peak used: {result['dtype']} GEMM on {best}, the best, {peak:.1f} GFLOP/s)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--prefill-seq-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--gemm-size", type=int, default=2048, help="largest square mm")
    parser.add_argument("--bandwidth-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument("--json", type=Path, default=RESULTS / "roofline.json")
    parser.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="kvstep with EngineConfig.torch_compile (compiled at load, outside the timing)",
    )
    # A child process's flags (one engine over the parent's checkpoint): not for users.
    parser.add_argument(
        "--engine",
        choices=["both", "kvstep", "transformers"],
        default="both",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--model-path", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.engine != "both":  # a child process of the run below
        if args.model_path is None:
            parser.error(f"--engine {args.engine} times one engine over --model-path")
        timer = time_kvstep if args.engine == "kvstep" else time_transformers
        child = timer(args.model_path, args)
        args.json.write_text(json.dumps(child))
        return child

    result: dict[str, Any] = {
        "dtype": args.dtype,
        "torch_compile": args.torch_compile,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "prefill_tokens": args.prefill_tokens,
        "prefill_seq_len": args.prefill_seq_len,
        "decode_tokens": args.decode_tokens,
    }
    for name in ("float32", "bfloat16"):
        kernels = available_kernels(torch.device("cpu"), DTYPES[name])  # bf16 oneDNN: AVX-512
        per_kernel = {k: gemm_peak(DTYPES[name], args.gemm_size, args.repeats, k) for k in kernels}
        result[f"gemm_{name}_kernels"] = per_kernel
        best = max(per_kernel, key=lambda k: per_kernel[k]["gflop_s"])
        result[f"gemm_{name}"] = per_kernel[best]
        result[f"gemm_{name}_kernel"] = best
    result["read_bandwidth_gb_s"] = read_bandwidth(args.bandwidth_mib, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        result["model_parameters"] = build_model(path)
        counts = model_counts(path, args.dtype, args.prefill_seq_len)
        gemv_s = gemv_floor(weight_shapes(path), DTYPES[args.dtype], args.repeats)
        timed = {
            engine: _in_subprocess(engine, path, args) for engine in ("kvstep", "transformers")
        }
    result.update(counts)
    peak = result[f"gemm_{args.dtype}"]["gflop_s"]
    bound_s = counts["weight_bytes"] / (result["read_bandwidth_gb_s"] * 1e9)
    result.update(gemm_peak_gflop_s=peak, decode_bound_ms=bound_s * 1e3)
    result.update(gemv_floor_ms=gemv_s * 1e3, gemv_gb_s=counts["weight_bytes"] / gemv_s / 1e9)
    n_seqs = args.prefill_tokens // args.prefill_seq_len
    flops = counts["prefill_flops_per_token"] * args.prefill_tokens
    flops += 2 * counts["lm_head_params"] * n_seqs
    result["prefill_flops"] = flops
    for engine, t in timed.items():
        rate = flops / t["prefill_s"] / 1e9
        result[engine] = {
            **t,
            "prefill_gflop_s": rate,
            "prefill_peak_fraction": rate / peak,
            "decode_ms": t["decode_s_per_token"] * 1e3,
            "decode_x_bound": t["decode_s_per_token"] / bound_s,
            "decode_x_gemv_floor": t["decode_s_per_token"] / gemv_s,
        }
    _report(result)
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
