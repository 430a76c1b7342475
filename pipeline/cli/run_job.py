"""The ``kvstep run`` job: a shared-prefix workload run twice, across an engine restart.

The first pass runs on one engine, which saves its KV blocks to a ``shared_storage``
directory; the second pass runs on a *new* engine (a restart) sharing that directory,
with ``enable_prefix_caching=False`` so every reused token visibly comes from the store.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs

from pipeline.cli.run_files import prepare_run_files
from pipeline.config import EngineConfig, SamplingParams

__all__ = ["PassResult", "RunOptions", "cache_dir", "default_run_config", "run_job"]


def cache_dir() -> Path:
    """The kvstep cache directory: ``$KVSTEP_CACHE_DIR`` or ``~/.cache/kvstep``."""
    env = os.environ.get("KVSTEP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvstep"


@attrs.frozen(kw_only=True)
class RunOptions:
    """The workload of ``kvstep run``.

    Attributes:
        num_prompts: Prompts per pass.
        prefix_len: Tokens of the prefix every prompt shares.
        suffix_len: Tokens after the prefix, different for each prompt.
        max_tokens: Tokens generated per request.
        keep_store: Keep what the store holds from earlier runs (else it is cleared
            first, so the first pass really misses).
    """

    num_prompts: int = 16
    prefix_len: int = 192
    suffix_len: int = 32
    max_tokens: int = 16
    keep_store: bool = False


@attrs.frozen(kw_only=True)
class PassResult:
    """What one pass measured.

    Attributes:
        name: ``"first"`` or ``"second"``.
        requests: Requests run.
        tokens: Tokens generated.
        wall_s: Wall time of the pass.
        tokens_per_s: Generated tokens per second of wall time.
        ttft_ms_median: Median time to first token.
        loaded_tokens: Tokens loaded from the store (step log's ``loaded_tokens``, or
            the outputs' ``num_cached_tokens`` without a step log).
        steps: Engine steps of the pass.
        finalizer_runs: ``clear`` stage records in the step log during the pass.
        leaks: Sum of the engine's leak report (without cached blocks) after the pass.
    """

    name: str
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms_median: float
    loaded_tokens: int
    steps: int
    finalizer_runs: int
    leaks: int


def default_run_config(**overrides: Any) -> EngineConfig:
    """The run job's engine: ``builtin:tiny`` + ``shared_storage`` under the cache dir.

    ``overrides`` (non-``None`` values only) replace fields; without an explicit
    ``connector_options``, ``shared_storage`` gets ``{"path": <cache>/run-store}``.
    Without an explicit ``inline_forward``, the forward pass runs on the job's event
    loop (which serves nothing else) when the executor is ``inprocess``.
    """
    fields: dict[str, Any] = {
        "model": "builtin:tiny",
        "connector": "shared_storage",
        "enable_prefix_caching": False,
        "max_model_len": 1024,
        "step_log": str(cache_dir() / "run-steps.jsonl"),
    }
    fields.update({k: v for k, v in overrides.items() if v is not None})
    fields.setdefault("inline_forward", fields.get("executor", "inprocess") == "inprocess")
    if fields.get("connector") == "shared_storage" and not fields.get("connector_options"):
        fields["connector_options"] = {"path": str(cache_dir() / "run-store")}
    return EngineConfig(**fields)


def workload(options: RunOptions, vocab: int) -> list[list[int]]:
    """Deterministic prompts sharing a ``prefix_len`` prefix, each with its own suffix."""
    prefix = [(7 * i + 3) % vocab for i in range(options.prefix_len)]
    return [
        prefix + [(13 * i + 17 * p + 5) % vocab for i in range(options.suffix_len)]
        for p in range(options.num_prompts)
    ]


def _log_counts(path: Path | None, offset: int) -> tuple[int, int, int]:
    """(loaded_tokens, finalizer runs, new offset) of the step log past ``offset`` bytes."""
    if path is None or not path.exists():
        return 0, 0, offset
    import json

    loaded = clears = 0
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "step" and rec.get("kind") == "engine":
            loaded += int(rec.get("loaded_tokens") or 0)
        elif rec.get("event") == "stage" and rec.get("stage") == "clear":
            clears += 1
    return loaded, clears, offset + len(data)


async def _one_pass(
    name: str,
    config: EngineConfig,
    options: RunOptions,
    advance: Callable[[], None],
    log_offset: int,
) -> tuple[PassResult, int]:
    from pipeline.engine.async_engine import AsyncEngine

    params = SamplingParams(max_tokens=options.max_tokens, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    tokens = cached = 0
    async with AsyncEngine(config) as engine:
        prompts = workload(options, engine.core.model_config.vocab_size)

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
                    advance()

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(one, prompt)
        wall = time.perf_counter() - start
        steps = engine.num_steps
        leaks = sum(v for k, v in engine.leak_report().items() if k != "cached_blocks")
    log_path = Path(config.step_log) if config.step_log is not None else None
    loaded, clears, log_offset = _log_counts(log_path, log_offset)
    result = PassResult(
        name=name,
        requests=len(prompts),
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_ms_median=1000 * statistics.median(ttfts) if ttfts else 0.0,
        loaded_tokens=loaded if log_path is not None else cached,
        steps=steps,
        finalizer_runs=clears,
        leaks=leaks,
    )
    return result, log_offset


async def run_job(
    config: EngineConfig,
    options: RunOptions,
    advance: Callable[[], None] = lambda: None,
) -> list[PassResult]:
    """Run the workload twice, each pass on a fresh engine sharing the connector's store.

    Clears the ``shared_storage`` directory first unless ``options.keep_store``, and
    truncates the step log (the job's log holds this run only), but only what kvstep
    wrote: a directory or file that is not kvstep's is refused, untouched (see
    :func:`~pipeline.cli.run_files.prepare_run_files`). Blocks the event loop only briefly;
    cancelling it closes the engine of the pass in flight.

    Args:
        config: The engine of both passes.
        options: The workload.
        advance: Called once per finished request (drives a progress bar).

    Returns:
        The first and the second pass.

    Raises:
        InvalidConfigError: The store directory or the step log is not kvstep's.
    """
    store = config.connector_options.get("path") if config.connector == "shared_storage" else None
    await anyio.to_thread.run_sync(
        partial(
            prepare_run_files,
            Path(store) if isinstance(store, str | os.PathLike) else None,
            Path(config.step_log) if config.step_log is not None else None,
            clear_store=not options.keep_store,
            store_mode=0o770 if config.connector_options.get("allow_shared") is True else 0o700,
        )
    )
    results: list[PassResult] = []
    offset = 0
    for name in ("first", "second"):
        result, offset = await _one_pass(name, config, options, advance, offset)
        results.append(result)
    return results
