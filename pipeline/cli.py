"""The ``kvstep`` command line. Every ``EngineConfig`` field is also a flag."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from pipeline.config import EngineConfig, SamplingParams
from pipeline.errors import KvstepError

__all__ = ["main"]


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    for field in attrs.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if field.name == "connector_options":
            parser.add_argument(flag, type=json.loads, default=None, help="JSON object")
        elif "bool" in kind:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif "int" in kind and "str" not in kind:
            parser.add_argument(flag, type=int, default=None)
        elif "float" in kind:
            parser.add_argument(flag, type=float, default=None)
        else:
            parser.add_argument(flag, default=None)


def _config_from(args: argparse.Namespace, **defaults: Any) -> EngineConfig:
    fields = dict(defaults)
    for field in attrs.fields(EngineConfig):
        value = getattr(args, field.name, None)
        if value is not None:
            fields[field.name] = value
    return EngineConfig(**fields)


def _workload(num_prompts: int, prefix_len: int, suffix_len: int, vocab: int) -> list[list[int]]:
    prefix = [(7 * i + 3) % vocab for i in range(prefix_len)]
    return [
        prefix + [(13 * i + 17 * p + 5) % vocab for i in range(suffix_len)]
        for p in range(num_prompts)
    ]


async def _run_pass(
    engine: Any, prompts: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    ttfts: list[float] = []
    tokens = 0
    cached = 0
    start = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        nonlocal tokens, cached
        t0 = time.perf_counter()
        first = True
        async for out in engine.generate(prompt, params):
            if first and out.new_token_ids:
                ttfts.append(time.perf_counter() - t0)
                first = False
            if out.finished:
                tokens += len(out.token_ids)
                cached += out.num_cached_tokens

    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(one, prompt)
    wall = time.perf_counter() - start
    return {
        "requests": len(prompts),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms_median": 1000 * statistics.median(ttfts) if ttfts else 0.0,
        "cached_prompt_tokens": cached,
    }


async def _run(config: EngineConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    from pipeline.async_engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        vocab = engine.core.model_config.vocab_size
        prompts = _workload(args.num_prompts, args.prefix_len, args.suffix_len, vocab)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        results = []
        for name in ("first", "second"):
            before = engine.num_steps
            result = await _run_pass(engine, prompts, params)
            result["pass"] = name
            result["steps"] = engine.num_steps - before
            results.append(result)
        leaks = engine.leak_report()
    for result in results:
        result["leaks"] = sum(v for k, v in leaks.items() if k != "cached_blocks")
    return results


def _print_table(results: list[dict[str, Any]]) -> None:
    columns = [
        ("pass", "pass"),
        ("requests", "requests"),
        ("tokens", "tokens"),
        ("tokens_per_s", "tokens/s"),
        ("ttft_ms_median", "TTFT ms (median)"),
        ("cached_prompt_tokens", "prompt tokens reused"),
        ("steps", "steps"),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kvstep run")
        for _, title in columns:
            table.add_column(title, justify="right")
        for r in results:
            table.add_row(*(_fmt(r[key]) for key, _ in columns))
        Console().print(table)
    except ImportError:
        print(" | ".join(title for _, title in columns))
        for r in results:
            print(" | ".join(_fmt(r[key]) for key, _ in columns))


def _fmt(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstep`` console script."""
    parser = argparse.ArgumentParser(prog="kvstep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a workload twice on the embedded default")
    _add_config_flags(run)
    run.add_argument("--num-prompts", type=int, default=16)
    run.add_argument("--prefix-len", type=int, default=192)
    run.add_argument("--suffix-len", type=int, default=32)
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        config = _config_from(args, step_log=args.step_log or "kvstep-steps.jsonl")
        results = anyio.run(_run, config, args)
    except KvstepError as exc:
        print(f"kvstep: error: {exc}", file=sys.stderr)
        return 2
    _print_table(results)
    print(f"step log: {Path(str(config.step_log)).resolve()}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
