"""Worker processes: what ``executor="multiproc"`` costs per step, and what TP=2 buys.

**1. Per-step fan-in overhead.** Median µs of one engine step (``EngineCore.step()``
timed with ``perf_counter_ns`` around the await, step log off, so the number is the
whole ``schedule → execute → fan_in → update`` graph plus the engine's bookkeeping) of
``multiproc`` with 2 worker processes against ``inprocess`` with 1 and 2 virtual ranks,
on ``builtin:tiny``, with a batch of ``--batch`` requests in decode (one token each per
step), two ways:

* **no-op**: every rank's worker graph keeps its shape
  ``bind → load → forward → {sample | save} → finished ⟂ clear`` but ``bind``, ``load``,
  ``forward``, ``sample`` and ``save`` are no-op stages producing the same artifacts
  (the driver's ``sample`` returns a fixed token per request, so requests keep
  decoding); ``finished`` and ``clear`` are the real ones (no connector: nothing to
  ask). No model runs: the number is executor + transport (msgspec over a socket
  pair) + fan-in. The worker graph is given as the import path
  ``"workers:noop_worker_graph"`` (this module; worker processes get the engine's
  ``sys.path``).
* **model**: the default worker graph, the real tiny model (each multiproc rank holds
  half of it, tensor-parallel over gloo; each in-process rank the whole model).

All six engines (3 executors, 2 worker graphs) are started at once, so the worker
processes' starts overlap; the three engines of one worker graph are then stepped in
``--rounds`` alternating rounds (so they share any drift) while the other three idle.
The prefill step and ``--warmup`` decode steps of each engine are not timed. Ratios are
multiproc/inprocess.

**2. Throughput.** Generated tokens/s of ``LLM.generate`` on the ~30M-parameter random
Llama of ``benchmarks/throughput.py`` (float32, greedy, ``--prompts`` prompts of
``--prompt-len`` tokens, ``--new-tokens`` new tokens each) with TP=1 (``inprocess``, 1
rank), TP=1 in a worker process (``multiproc``, 1 rank: the price of being in another
process) and TP=2 (``multiproc``, 2 ranks). The model runs in a fresh process in each
case: the in-process engine in a child process of its own (as in ``throughput.py``),
the multiproc engines from this process (their engine side runs no torch) in new worker
processes; the two multiproc engines are started together and measured one after the
other. Each generates once untimed and then ``--repeats`` times (the best run counts).
Worker processes set torch's threads to ``cores // world_size``; the in-process engine
uses torch's default. Greedy outputs are compared with TP=1 in-process, request by
request ("same as TP1"), and across all three.

On a machine shared with other work the numbers are only indicative: in-process torch
on all cores is the most sensitive to other load.

    python benchmarks/workers.py [--steps 300] [--batch 8] [--prompts 16]
        [--prompt-len 128] [--new-tokens 32] [--json PATH]

JSON goes to ``benchmarks/results/workers.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import perf_counter_ns
from typing import Any, ClassVar

import anyio
import anyio.to_thread
import attrs
import torch
from _noop import NoopStage
from _results import RESULTS, save

from pipeline import LLM, EngineConfig, SamplingParams
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

NOOP_GRAPH = "workers:noop_worker_graph"
NOOP_TOKEN = 3  # what the no-op ``sample`` "samples" (not EOS; EOS is ignored anyway)
# Part 1's engines: (label, executor, world size).
STEP_VARIANTS = (("inprocess 1", "inprocess", 1), ("inprocess 2", "inprocess", 2),
                 ("multiproc 2", "multiproc", 2))  # fmt: skip
# Part 2's engines: (label, executor, world size); the first is the reference.
TP_VARIANTS = (("TP1 inprocess", "inprocess", 1), ("TP1 multiproc", "multiproc", 1),
               ("TP2 multiproc", "multiproc", 2))  # fmt: skip


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
    noops = [
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


# ------------------------------------------------------------ part 2: tokens/s, TP=2


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def tp_config(executor: str, world_size: int, path: Path, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        executor=executor,
        world_size=world_size,
        max_num_batched_tokens=args.prompts * args.prompt_len,
        max_num_seqs=args.prompts,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        enable_prefix_caching=False,
    )


def best_generate(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    """Best of ``--repeats`` timed ``generate`` runs after one untimed run, and the tokens."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 8192, (args.prompts, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if i:
            times.append(time.perf_counter() - t0)
    errors = [(o.request_id, o.error) for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{llm.config.executor}/{llm.config.world_size} failed: {errors}")
    executor, world_size = llm.config.executor, llm.config.world_size
    threads = torch.get_num_threads() if executor == "inprocess" else _cores() // world_size
    return {
        "seconds": min(times),
        "threads_per_rank": max(1, threads),
        "tokens": [list(o.token_ids) for o in outs],
    }


def run_inprocess(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The TP=1 in-process engine (run in a child process of its own)."""
    start = time.perf_counter()
    with LLM(tp_config("inprocess", 1, path, args)) as llm:
        start_s = time.perf_counter() - start
        return {**best_generate(llm, args), "start_s": start_s}


def run_multiproc(path: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The multiproc engines, started together (their worker processes' starts overlap),
    then measured one after the other while the others idle."""
    variants = [v for v in TP_VARIANTS if v[1] == "multiproc"]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(variants)) as pool:
        start = time.perf_counter()
        futures = [pool.submit(LLM, tp_config(e, n, path, args)) for _, e, n in variants]
        llms, errors = [], []
        for future in futures:  # every start is awaited, so none is left open on error
            try:
                llms.append(stack.enter_context(future.result()))
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        start_s = time.perf_counter() - start
        return {
            label: {**best_generate(llm, args), "start_s": start_s}
            for (label, _, _), llm in zip(variants, llms, strict=True)
        }


def _in_subprocess(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """An in-process engine runs in a fresh process (see ``throughput.py``: torch state
    left by earlier torch work on other threads, here part 1's, slows it down)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--child", "--model-path", str(path),
               "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def measure_tp(args: argparse.Namespace) -> dict[str, Any]:
    from throughput import build_model  # the same ~30M Llama as throughput.py

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        t0 = time.perf_counter()
        params = build_model(path)
        model_config = json.loads((path / "config.json").read_text())
        t1 = time.perf_counter()
        runs[TP_VARIANTS[0][0]] = _in_subprocess(path, args)
        t2 = time.perf_counter()
        # The multiproc engines run from this process: their model runs in worker
        # processes, which start fresh anyway.
        runs.update(run_multiproc(path, args))
        t3 = time.perf_counter()
    phases = {"build_model_s": t1 - t0, "inprocess_child_s": t2 - t1, "multiproc_s": t3 - t2}
    total = args.prompts * args.new_tokens
    ref_label = TP_VARIANTS[0][0]
    ref = runs[ref_label]["tokens"]
    rows = {}
    for label, executor, world_size in TP_VARIANTS:
        run = runs[label]
        same = sum(a == b for a, b in zip(ref, run["tokens"], strict=True)) / len(ref)
        rows[label] = {
            "executor": executor,
            "world_size": world_size,
            "threads_per_rank": run["threads_per_rank"],
            "start_s": round(run["start_s"], 2),
            "seconds": round(run["seconds"], 3),
            "tok_s": round(total / run["seconds"], 1),
            "match_vs_tp1_inprocess": same,
        }
    tp1, mp1, tp2 = (rows[label]["tok_s"] for label, _, _ in TP_VARIANTS)
    outputs = [runs[label]["tokens"] for label, _, _ in TP_VARIANTS]
    all_three = sum(a == b == c for a, b, c in zip(*outputs, strict=True)) / len(ref)
    return {
        "model_parameters": params,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "runs": rows,
        "ratio_tp2_vs_tp1_inprocess": round(tp2 / tp1, 2),
        "ratio_tp2_vs_tp1_multiproc": round(tp2 / mp1, 2),
        "ratio_tp1_multiproc_vs_inprocess": round(mp1 / tp1, 2),
        "identical_outputs_all_three": all_three,
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "batch_rows": args.prompts,  # a decode step's rows
        "hidden_size": model_config["hidden_size"],
        "reductions_per_step": 2 * model_config["num_hidden_layers"],
    }


# ------------------------------------------------------------------------- output


def print_table(title: str, headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{h:>14}" for h in headers))
        for row in rows:
            print("  ".join(f"{c:>14}" for c in row))
    else:
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=120).print(table)


_ECHO = """
import socket, sys, anyio
from pipeline.executors import wire
from pipeline.artifacts import WorkerOutput
from pipeline.executors.channel import Channel

async def serve(channel):
    while True:
        message = await channel.recv()
        if isinstance(message, wire.Shutdown):
            return
        step_id = message.scheduler_output.step_id
        await channel.send(wire.StepDone(WorkerOutput(rank=0, step_id=step_id), []))

anyio.run(serve, Channel(socket.socket(fileno=int(sys.argv[1])), peer="engine"))
"""


async def measure_round_trip(n: int) -> float:
    """Median µs of one Step → StepDone exchange with an echo process: the floor of what
    the process boundary costs per step (a socket pair, msgspec, two wake-ups)."""
    import socket
    import subprocess

    from pipeline.artifacts import SchedulerOutput
    from pipeline.executors import wire
    from pipeline.executors.channel import Channel

    mine, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env
    )
    theirs.close()
    channel = Channel(mine, peer="echo")
    samples: list[int] = []
    try:
        for step_id in range(n + 50):
            start = time.perf_counter_ns()
            await channel.send(wire.encode_step(SchedulerOutput(step_id=step_id)))
            await channel.recv(alive=lambda: proc.poll() is None)
            if step_id >= 50:
                samples.append(time.perf_counter_ns() - start)
        await channel.send(wire.Shutdown())
    finally:
        proc.wait(timeout=30)
        channel.close()
    return round(statistics.median(samples) / 1000, 1)


_ALL_REDUCE = """
import json, statistics, sys, time
import torch
import torch.distributed as dist
from stages.forward.shm_allreduce import SharedMemoryAllReduce
rank, workdir, rows, hidden, n = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{workdir}/rdv", rank=rank, world_size=2)
shm = SharedMemoryAllReduce(f"{workdir}/shm", rank=rank, size=2, slot_bytes=rows * hidden * 4,
                            fallback=dist.all_reduce, timeout_s=60)
x = torch.randn(rows, hidden)
result = {}
for name, reduce in (("gloo", dist.all_reduce), ("shared_memory", shm)):
    for _ in range(20):
        reduce(x)
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        reduce(x)
        samples.append(time.perf_counter_ns() - start)
    result[name] = round(statistics.median(samples) / 1000, 1)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(result))
"""


def measure_all_reduce(rows: int, hidden: int, n: int = 100) -> dict[str, float]:
    """Median µs of one all-reduce of a float32 ``[rows, hidden]`` between two processes,
    with gloo and with the shared-memory reduce that ``multiproc`` CPU ranks use: what
    each of a tensor-parallel layer's two reductions costs here."""
    import subprocess
    import tempfile

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        argv = [tmp, str(rows), str(hidden), str(n)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _ALL_REDUCE, str(rank), *argv],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
            )
            for rank in (0, 1)
        ]
        out = [proc.communicate(timeout=120)[0] for proc in procs]
    result: dict[str, float] = json.loads(out[0])
    return result


def print_results(result: dict[str, Any]) -> None:
    steps = result["steps"]
    rows = []
    for kind in ("noop", "model"):
        part = steps[kind]
        med = part["median_us"]
        rows.append(
            (
                kind,
                *(f"{med[label]:.0f}" for label, _, _ in STEP_VARIANTS),
                f"{part['ratio_multiproc2_vs_inprocess1']:.2f}x",
                f"{part['ratio_multiproc2_vs_inprocess2']:.2f}x",
                f"{part['multiproc2_added_us_vs_inprocess2']:.0f}",
            )
        )
    print_table(
        f"µs per engine step (median of {result['config']['steps']} decode steps, batch "
        f"{result['config']['batch']}, builtin:tiny)",
        (
            "worker graph",
            *(f"{label} µs" for label, _, _ in STEP_VARIANTS),
            "mp2/ip1",
            "mp2/ip2",
            "mp2-ip2 µs",
        ),
        rows,
    )
    print(
        f"bare round trip engine -> echo process -> engine (msgspec over a socket pair): "
        f"{steps['round_trip_us']:.0f} µs median"
    )
    tp = result["tp"]
    print_table(
        f"Throughput ({tp['model_parameters'] / 1e6:.0f}M Llama, {tp['prompts']} prompts"
        f" x {tp['prompt_len']} tokens, {tp['new_tokens']} new tokens, float32, greedy)",
        ("engine", "threads/rank", "seconds", "tokens/s", "same as TP1"),
        [
            (
                label,
                str(r["threads_per_rank"]),
                f"{r['seconds']:.2f}",
                f"{r['tok_s']:.1f}",
                f"{r['match_vs_tp1_inprocess']:.0%}",
            )
            for label, r in tp["runs"].items()
        ],
    )
    ar = tp["all_reduce_us"]
    print(
        f"all-reduce between 2 processes, float32 [{tp['batch_rows']}, {tp['hidden_size']}] "
        f"(one decode step's reduction; a step makes {tp['reductions_per_step']}): "
        f"gloo {ar['gloo']:.0f} µs, shared memory {ar['shared_memory']:.0f} µs (median)"
    )
    print(
        f"TP2/TP1 tokens/s: {tp['ratio_tp2_vs_tp1_inprocess']:.2f}x vs in-process, "
        f"{tp['ratio_tp2_vs_tp1_multiproc']:.2f}x vs one worker process; "
        f"TP1 multiproc/inprocess: {tp['ratio_tp1_multiproc_vs_inprocess']:.2f}x; "
        f"identical greedy outputs in all three: {tp['identical_outputs_all_three']:.0%}"
    )


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "anyio": importlib.metadata.version("anyio"),
        "msgspec": importlib.metadata.version("msgspec"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cores": _cores(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per engine")
    parser.add_argument("--warmup", type=int, default=20, help="untimed decode steps first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (part 1)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding (part 1)")
    parser.add_argument("--step-prompt-len", type=int, default=16, help="their prompt length")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best kept)")
    parser.add_argument("--json", type=Path, default=RESULTS / "workers.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "rounds", "step_prompt_len", "prompts", "prompt_len",
                 "new_tokens", "repeats"):  # fmt: skip
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.rounds > args.steps:
        parser.error("--warmup must be >= 0 and --rounds <= --steps")

    if args.child:  # the in-process engine's own process (see measure_tp)
        run = run_inprocess(args.model_path, args)
        args.json.write_text(json.dumps(run))
        return run

    wall = time.perf_counter()
    steps = anyio.run(measure_all_steps, args)
    steps["round_trip_us"] = anyio.run(measure_round_trip, args.steps)
    steps_s = time.perf_counter() - wall
    tp = measure_tp(args)
    tp["all_reduce_us"] = measure_all_reduce(tp["batch_rows"], tp["hidden_size"])
    result = {
        "benchmark": "workers",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "child", "model_path")},
        "timing": "EngineCore.step() wall time (perf_counter_ns), step log off",
        "steps": steps,
        "tp": tp,
        "environment": environment(),
        "wall_s": round(time.perf_counter() - wall, 1),
        "part1_s": round(steps_s, 1),
    }
    print_results(result)
    print(f"wall time: {result['wall_s']:.1f} s")
    save(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
