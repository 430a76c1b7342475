"""Part 1 of ``workers.py``: µs per engine step of ``multiproc`` against ``inprocess``,
with the model and with a no-op worker graph of the same shape (see ``workers.py``)."""

from __future__ import annotations

import argparse
import statistics
from time import perf_counter_ns
from typing import Any, ClassVar

import anyio
import anyio.to_thread
import attrs
import torch
from _noop import NoopStage

from pipeline import EngineConfig, SamplingParams
from pipeline.artifacts import (
    LoadStarted,
    MetadataBound,
    ModelOutput,
    SampledTokens,
    SaveResult,
    SchedulerOutput,
)
from pipeline.engine.core import EngineCore
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph

NOOP_GRAPH = "_worker_steps:noop_worker_graph"  # worker processes get the engine's sys.path
NOOP_TOKEN = 3  # what the no-op ``sample`` "samples" (not EOS; EOS is ignored anyway)
# The engines: (label, executor, world size).
STEP_VARIANTS = (("inprocess 1", "inprocess", 1), ("inprocess 2", "inprocess", 2),
                 ("multiproc 2", "multiproc", 2))  # fmt: skip


# ------------------------------------------------------------------ no-op worker graph


@attrs.frozen
class NoopSample:
    """``sample`` without a model: the driver rank "samples" ``NOOP_TOKEN`` per request."""

    name: ClassVar[str] = "sample"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, ModelOutput)
    provides: ClassVar[type] = SampledTokens

    driver: bool

    async def run(self, ctx: StepContext) -> SampledTokens:
        ctx.get(ModelOutput)
        if not self.driver:
            return SampledTokens()
        requests = ctx.get(SchedulerOutput).requests
        return SampledTokens(token_ids={r.req_id: NOOP_TOKEN for r in requests if r.sample})


def noop_worker_graph(default: StepGraph) -> StepGraph:
    """The default worker graph with its model and connector stages made no-ops.

    Same shape, same artifacts; ``finished`` and ``clear`` stay (without a connector
    they only build the ``WorkerOutput`` and clear nothing).
    """
    so = (SchedulerOutput,)
    noops: list[NoopStage | NoopSample] = [
        NoopStage("bind", so, MetadataBound, MetadataBound(False)),
        NoopStage("load", (*so, MetadataBound), LoadStarted, LoadStarted(False)),
        NoopStage("forward", (*so, LoadStarted), ModelOutput, ModelOutput(req_ids=(), logits=None)),
        NoopSample(driver=default["sample"].driver),  # type: ignore[attr-defined]
        NoopStage("save", (ModelOutput,), SaveResult, SaveResult()),
    ]
    graph = default
    for stage in noops:
        graph = graph.replace(stage.name, stage)
    return graph


# --------------------------------------------------------------- part 1: µs per step


def step_config(executor: str, world_size: int, args: argparse.Namespace) -> EngineConfig:
    max_tokens = args.warmup + args.steps + 4
    return EngineConfig(
        model="builtin:tiny",
        dtype="float32",
        device="cpu",
        executor=executor,
        world_size=world_size,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.batch * args.step_prompt_len, 256),
        max_model_len=args.step_prompt_len + max_tokens + 16,
        enable_prefix_caching=False,
    )


async def _timed_steps(core: EngineCore, n: int, batch: int, samples: list[int] | None) -> None:
    """``n`` engine steps; each must be a decode step of the whole batch."""
    for _ in range(n):
        t0 = perf_counter_ns()
        out = await core.step()
        dt = perf_counter_ns() - t0
        failed = [o for o in out.outputs if getattr(o, "failure", None) is not None]
        if failed or out.num_requests != batch or out.num_scheduled_tokens != batch:
            raise RuntimeError(
                f"step {out.step_id} of {core.config.executor}/{core.config.world_size} was "
                f"not a decode step of {batch} requests: {out.num_requests} requests, "
                f"{out.num_scheduled_tokens} tokens, failures: {[o.failure for o in failed]}"
            )
        if samples is not None:
            samples.append(dt)


async def measure_steps(
    cores: dict[str, EngineCore], args: argparse.Namespace, worker_graph: str | None
) -> dict[str, Any]:
    """Median µs per decode step of each engine of ``cores``, in alternating rounds."""
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(4, 512, (args.batch, args.step_prompt_len), generator=gen).tolist()
    params = SamplingParams(
        max_tokens=args.warmup + args.steps + 4, temperature=0.0, ignore_eos=True
    )
    samples: dict[str, list[int]] = {label: [] for label in cores}
    for label, core in cores.items():
        for prompt in prompts:
            core.add_request(core.new_request_id(), prompt, params)
        first = await core.step()  # prefill
        if first.num_requests != args.batch:
            raise RuntimeError(f"{label}: the first step scheduled {first.num_requests}")
        await _timed_steps(core, args.warmup, args.batch, None)
    per_round = [args.steps // args.rounds] * args.rounds
    per_round[-1] += args.steps - sum(per_round)
    for n in per_round:
        for label, core in cores.items():
            await _timed_steps(core, n, args.batch, samples[label])
    us = {label: statistics.median(s) / 1000.0 for label, s in samples.items()}
    p90 = {label: statistics.quantiles(s, n=10)[-1] / 1000.0 if len(s) > 1 else us[label]
           for label, s in samples.items()}  # fmt: skip
    mp = us["multiproc 2"]
    return {
        "worker_graph": worker_graph or "default",
        "median_us": {k: round(v, 1) for k, v in us.items()},
        "p90_us": {k: round(v, 1) for k, v in p90.items()},
        "ratio_multiproc2_vs_inprocess1": round(mp / us["inprocess 1"], 2),
        "ratio_multiproc2_vs_inprocess2": round(mp / us["inprocess 2"], 2),
        "multiproc2_added_us_vs_inprocess2": round(mp - us["inprocess 2"], 1),
    }


async def measure_all_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: every engine of both kinds is started at once (the worker processes'
    starts overlap), then each kind is measured while the other kind's engines idle."""
    graphs = {"noop": NOOP_GRAPH, "model": None}
    specs = [(kind, label, step_config(executor, world_size, args))
             for kind in graphs for label, executor, world_size in STEP_VARIANTS]  # fmt: skip
    cores: dict[tuple[str, str], EngineCore] = {}

    async def start(kind: str, label: str, config: EngineConfig) -> None:
        core = await anyio.to_thread.run_sync(lambda: EngineCore(config, worker_graph=graphs[kind]))
        cores[kind, label] = core

    try:
        async with anyio.create_task_group() as tg:
            for spec in specs:
                tg.start_soon(start, *spec)
        return {
            kind: await measure_steps(
                {label: cores[kind, label] for label, _, _ in STEP_VARIANTS}, args, graph
            )
            for kind, graph in graphs.items()
        }
    finally:
        with anyio.CancelScope(shield=True):
            for core in cores.values():
                await core.aclose()
