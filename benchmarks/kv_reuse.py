"""KV reuse: time to first token with a full connector hit vs recompute, and the
connector's KV load bandwidth vs a plain memcpy of the same bytes (same run).

    python benchmarks/kv_reuse.py [--prompts 3] [--prompt-len 2048] [--json PATH]

A ~100M-parameter random Llama (12 layers, hidden 768, GQA with 4 KV heads, tied 32k
embeddings), float32 on CPU, prefix caching off so every hit comes from the connector.
Per connector (one entry of ``CONNECTORS``): each prompt is generated once (a miss:
recompute + save), then again (a full hit: every full block loaded, the last token
computed); ``max_tokens=1`` so the wall time of ``generate`` is the TTFT. The
"recompute" baseline is the same prompt on an engine without a connector. Medians over
the prompts. Goals: TTFT >= 5x faster with a full hit; offload load bandwidth >= 50% of
memcpy. JSON goes to ``benchmarks/results/kv_reuse.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from _models import save_random_llama
from _results import RESULTS, save
from _serve_client import free_port

from pipeline import LLM, EngineConfig, SamplingParams

BLOCK = 16
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def build_model(path: Path, seed: int = 0) -> int:
    """A ~100M-parameter random Llama saved with save_pretrained; returns its size."""
    return save_random_llama(
        path,
        seed,
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


@attrs.frozen
class ConnectorCase:
    """One connector under test.

    Attributes:
        name: The registry name.
        options: ``connector_options`` from (scratch dir, blocks needed).
        bandwidth: Measures load bandwidth on a warm engine, or ``None``.
    """

    name: str
    options: Callable[[Path, int], dict[str, Any]]
    bandwidth: Callable[[LLM, list[int]], dict[str, float]] | None = None


def _timed_copy(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def offload_bandwidth(llm: LLM, prompt: list[int], repeats: int = 5) -> dict[str, float]:
    """Load every stored block of ``prompt`` from rank 0's host pool into the paged cache
    through the connector's own loader (a job on its thread, all layers), and a plain
    ``copy_`` of the same bytes between contiguous tensors, layer by layer."""
    from connectors.offload import LoadJob, OffloadScheduler, OffloadWorker, make_runs
    from pipeline.block_hashes import hash_request_tokens

    scheduler = llm.engine.core.connector
    worker = llm.engine.core.workers[0].connector.inner  # type: ignore[union-attr]
    assert isinstance(scheduler, OffloadScheduler) and isinstance(worker, OffloadWorker)
    hashes = hash_request_tokens(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
    slots = [scheduler.index.lookup((scheduler.fingerprint_key, h)) for h in hashes]
    assert all(s is not None for s in slots)
    pool, loader = worker.pool, worker._loader
    kv = loader.kv_caches  # type: ignore[union-attr]
    runs = make_runs((s, b, "bench") for b, s in enumerate(slots))  # type: ignore[misc]
    nbytes = len(slots) * pool.block_bytes  # type: ignore[union-attr]

    def load(verify: bool) -> Callable[[], None]:
        def run() -> None:
            job = LoadJob(runs, len(kv), frozenset({"bench"}), verify)
            loader.submit(job)  # type: ignore[union-attr]
            job.done.wait()
            assert not job.failed_blocks

        return run

    sources = [layer[: len(slots)].clone() for layer in pool.layers]  # type: ignore[union-attr]
    targets = [torch.empty_like(s) for s in sources]

    def memcpy() -> None:
        for dst, src in zip(targets, sources, strict=True):
            dst.copy_(src)

    if pool.sums is None:  # type: ignore[union-attr]
        worker.pool.sums = torch.zeros(len(kv), pool.num_slots, dtype=torch.int64)  # type: ignore[union-attr]
    pool.record_checksums(runs)  # type: ignore[union-attr]
    t_load = _timed_copy(load(False), repeats)
    t_verify = _timed_copy(load(True), repeats)
    t_copy = _timed_copy(memcpy, repeats)
    return {
        "load_bytes": nbytes,
        "load_runs": len(runs),
        "load_GBps": nbytes / t_load / 1e9,
        "load_verified_GBps": nbytes / t_verify / 1e9,
        "memcpy_GBps": nbytes / t_copy / 1e9,
        "load_vs_memcpy": t_copy / t_load,
        "load_verified_vs_memcpy": t_copy / t_verify,
    }


def shared_storage_bandwidth(llm: LLM, prompt: list[int], repeats: int = 3) -> dict[str, float]:
    """Load every stored block of ``prompt`` from rank 0's directory into the paged cache
    through the connector's own reader (a :class:`StoreLoad` thread: per-layer lazy reads,
    each checksum verified; files likely in the page cache), and a plain ``copy_`` of the
    same bytes between contiguous tensors, layer by layer."""
    from connectors.shared_storage import BlockRef, SharedStorageWorker
    from connectors.shared_storage.loader import StoreLoad
    from pipeline.block_hashes import hash_request_tokens

    worker = llm.engine.core.workers[0].connector.inner  # type: ignore[union-attr]
    assert isinstance(worker, SharedStorageWorker)
    hashes = hash_request_tokens(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
    refs = [BlockRef("bench", block_id, h) for block_id, h in enumerate(hashes)]
    kv = worker.kv_caches
    nbytes = len(refs) * worker.block_bytes

    def load() -> None:
        job = StoreLoad(worker.store, worker.fingerprint_key, refs, kv)
        job.start()
        job.done.wait()
        assert not job.failed_blocks

    sources = [layer[:, : len(refs)].clone() for layer in kv]
    targets = [torch.empty_like(s) for s in sources]

    def memcpy() -> None:
        for dst, src in zip(targets, sources, strict=True):
            dst.copy_(src)

    t_load, t_copy = _timed_copy(load, repeats), _timed_copy(memcpy, repeats)
    return {
        "load_bytes": nbytes,
        "load_verified_GBps": nbytes / t_load / 1e9,
        "memcpy_GBps": nbytes / t_copy / 1e9,
        "load_verified_vs_memcpy": t_copy / t_load,
    }


CONNECTORS = [
    ConnectorCase("offload", lambda tmp, blocks: {"num_blocks": blocks}, offload_bandwidth),
    ConnectorCase(
        "shared_storage", lambda tmp, blocks: {"path": str(tmp / "kv")}, shared_storage_bandwidth
    ),
]


def _redis_available() -> bool:
    """A server to benchmark: ``$KVSTEP_REDIS_URL``, or ``redis-server`` on PATH (and the
    ``redis`` package); without one the redis entry is skipped."""
    import importlib.util
    import os
    import shutil

    if importlib.util.find_spec("redis") is None:
        return False
    return bool(os.environ.get("KVSTEP_REDIS_URL")) or shutil.which("redis-server") is not None


def _redis_options(tmp: Path, blocks: int) -> dict[str, Any]:
    """``$KVSTEP_REDIS_URL``, or a throwaway local ``redis-server`` (killed at exit), with a
    key prefix of its own so repeated runs start with a miss."""
    import atexit
    import os
    import shutil
    import subprocess
    import uuid

    import redis

    url = os.environ.get("KVSTEP_REDIS_URL")
    if not url:
        port = free_port()
        server = shutil.which("redis-server") or "redis-server"
        args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        proc = subprocess.Popen(
            [*args, "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL
        )
        atexit.register(proc.kill)
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(500):
            try:
                if redis.Redis.from_url(url, socket_timeout=0.5).ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.02)
    return {"url": url, "key_prefix": f"bench-{uuid.uuid4().hex[:8]}:", "timeout_s": 0.2}


if _redis_available():
    CONNECTORS.append(ConnectorCase("redis", _redis_options))


def engine_config(path: Path, prompt_len: int, blocks: int, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        max_num_batched_tokens=prompt_len,
        max_num_seqs=4,
        max_model_len=prompt_len + BLOCK,
        num_gpu_blocks=blocks,
        enable_prefix_caching=False,
        **overrides,
    )


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, Any]:
    start = time.perf_counter()
    (out,) = llm.generate([prompt], ONE_TOKEN)
    return time.perf_counter() - start, out


def run_case(
    case: ConnectorCase, path: Path, prompts: list[list[int]], recompute: list[tuple[int, ...]]
) -> dict[str, Any]:
    """Miss then full hit for every prompt on one engine; outputs must match."""
    blocks = (len(prompts) + 2) * (len(prompts[0]) // BLOCK + 1)
    with tempfile.TemporaryDirectory() as tmp:
        options = case.options(Path(tmp), blocks)
        config = engine_config(
            path, len(prompts[0]), blocks, connector=case.name, connector_options=options
        )
        with LLM(config) as llm:
            llm.generate([prompts[0][:64]], ONE_TOKEN)  # warm-up
            miss, hit, cached, same = [], [], [], True
            for prompt, expected in zip(prompts, recompute, strict=True):
                t_miss, first = ttft(llm, prompt)
                t_hit, second = ttft(llm, prompt)
                miss.append(t_miss)
                hit.append(t_hit)
                cached.append(second.num_cached_tokens)
                same &= first.token_ids == second.token_ids == expected
            result: dict[str, Any] = {
                "ttft_miss_s": statistics.median(miss),
                "ttft_hit_s": statistics.median(hit),
                "hit_cached_tokens": statistics.median(cached),
                "identical_outputs": same,
            }
            if case.bandwidth is not None:
                result.update(case.bandwidth(llm, prompts[0]))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=RESULTS / "kv_reuse.json")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 32000, (args.prompts, args.prompt_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-100m"
        params = build_model(path)
        blocks = 3 * (args.prompt_len // BLOCK + 1)
        with LLM(engine_config(path, args.prompt_len, blocks)) as llm:
            llm.generate([prompts[0][:64]], ONE_TOKEN)  # warm-up
            base = [ttft(llm, p) for p in prompts]
        recompute_s = statistics.median(t for t, _ in base)
        tokens = [out.token_ids for _, out in base]
        cases = {case.name: run_case(case, path, prompts, tokens) for case in CONNECTORS}

    for res in cases.values():
        res["ttft_speedup"] = recompute_s / res["ttft_hit_s"]
    result = {
        "model_parameters": params,
        "prompt_len": args.prompt_len,
        "prompts": args.prompts,
        "threads": torch.get_num_threads(),
        "ttft_recompute_s": recompute_s,
        "connectors": cases,
    }
    print(f"recompute TTFT (no connector): {recompute_s * 1e3:.1f} ms, {params / 1e6:.0f}M params")
    head = f"{'connector':<12}{'miss ms':>9}{'hit ms':>9}{'speedup':>9}{'load GB/s':>11}"
    print(head + f"{'verified':>10}{'memcpy':>8}{'ratio':>7}  same")
    for name, res in cases.items():
        bw = [res.get(k) for k in ("load_GBps", "load_verified_GBps", "memcpy_GBps")]
        ratio = res.get("load_vs_memcpy")
        cells = "".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in bw)
        print(
            f"{name:<12}{res['ttft_miss_s'] * 1e3:>9.1f}{res['ttft_hit_s'] * 1e3:>9.1f}"
            f"{res['ttft_speedup']:>8.1f}x {cells}"
            f"{(f'{ratio:.0%}' if ratio is not None else '-'):>7}  {res['identical_outputs']}"
        )
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
