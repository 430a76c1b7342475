"""Part 3 of ``benchmarks/disagg.py``: decode ITL while long prompts keep arriving,
colocated against disaggregated.

Setups (real processes on loopback, started and stopped by ``_disagg_procs.py``;
``builtin:tiny``, float32 on CPU, each engine process with ``OMP_NUM_THREADS`` =
``threads``):

* colocated: one ``kvstep serve``; every request goes to it.
* disaggregated: ``kvstep serve --kv-role producer`` + ``kvstep serve --kv-role
  consumer`` + ``kvstep proxy``; every request goes to the proxy, which prefills it on
  the producer (``max_tokens=1``) and streams the rest from the consumer, which reads
  the prompt's KV over NIXL.

Workload, the same for both: ``streams`` decode streams (short prompts, ``stream_tokens``
output tokens each, ``ignore_eos``) sent at once; the measured samples are every gap
between two of their token chunks (``ClientRecord.itls_s`` of ``benchmarks/serve.py``'s
client). "loaded": long prompts (``long_tokens`` tokens of random words, ``long_max_tokens``
output tokens) are sent at a steady ``rate`` from one interval before the streams start
until they have all finished, skipping a tick while ``long_inflight`` of them are still
unanswered (so a server that falls behind is not buried and the round still ends; the
report gives the rate achieved); "no-load": the same streams alone. Both setups run at
once (the idle one waits on its sockets) and the rounds alternate layout (unpinned, and
pinned when asked: ``_disagg_procs.pin_plan``), setup and workload, ``rounds`` times
each, with fresh prompts every round, so a change in the machine's load falls on all
of them alike. Around each round, every process's CPU run and wait time is read from
``/proc`` (``_sched_stats.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import httpx
import numpy as np
from _disagg_procs import MODEL, pin_plan, running
from _sched_stats import CpuTimes, pin, since, snapshots
from _serve_client import WORDS, ClientRecord, RequestSpec, send_one
from _serve_metrics import SAMPLE_QUANTILE

SETUPS = ("colocated", "disaggregated")
MODES = ("no_load", "loaded")
ROUND_TIMEOUT_S = 600.0


@attrs.frozen(kw_only=True)
class Workload:
    """What part 3 sends (see the module docstring)."""

    streams: int = 4
    stream_tokens: int = 128
    stream_prompt_tokens: int = 32
    long_tokens: int = 1500
    long_max_tokens: int = 4
    rate: float = 2.0
    long_inflight: int = 2
    rounds: int = 3
    threads: int = 1


# -- the workload ---------------------------------------------------------------------


class Prompts:
    """Random-word prompts of about a given number of ``builtin:tiny`` tokens: the word
    count for a length is fitted once with the tokenizer, so a prompt made while a
    round is timed costs only the random choice (usage reports the real counts)."""

    def __init__(self, seed: int) -> None:
        from pipeline.tokenizer import load_tokenizer
        from stages.model.builtin import tokenizer_dir

        tokenizer = load_tokenizer(tokenizer_dir(MODEL))
        assert tokenizer is not None, "builtin:tiny carries a tokenizer"
        self._tokenizer = tokenizer
        self._rng = random.Random(seed)
        self._words: dict[int, int] = {}

    def _fit(self, tokens: int) -> int:
        words = [self._rng.choice(WORDS) for _ in range(max(1, tokens // 2))]
        while len(self._tokenizer.encode(" ".join(words))) < tokens:
            words += [self._rng.choice(WORDS) for _ in range(8)]
        while len(words) > 1 and len(self._tokenizer.encode(" ".join(words))) > tokens:
            words.pop()
        return len(words)

    def __call__(self, tokens: int) -> str:
        if tokens not in self._words:
            self._words[tokens] = self._fit(tokens)
        return " ".join(self._rng.choice(WORDS) for _ in range(self._words[tokens]))


@attrs.frozen
class Round:
    """One round: the decode streams' and the long prompts' records, the ticks at which
    no prompt was sent because ``long_inflight`` were unanswered, the time from the
    round's start to its streams' end (and both as unix times), and what each process's
    threads ran and waited between the ``/proc`` reads around the round, which lie
    ``cpu_window_s`` apart."""

    streams: list[ClientRecord]
    longs: list[ClientRecord]
    skipped: int
    window_s: float
    start_ts: float = 0.0
    end_ts: float = 0.0
    cpu: dict[str, CpuTimes] = attrs.field(factory=dict)
    cpu_window_s: float = 0.0


async def run_round(url: str, work: Workload, prompts: Prompts, loaded: bool) -> Round:
    """Send the decode streams (and, when ``loaded``, long prompts at ``work.rate``
    from one interval before them until they end); return when all have ended.

    Raises:
        TimeoutError: The round took longer than ``ROUND_TIMEOUT_S``.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    streams = [
        RequestSpec(0.0, prompts(work.stream_prompt_tokens), 0, work.stream_tokens)
        for _ in range(work.streams)
    ]
    stream_records: list[ClientRecord] = []
    long_records: list[ClientRecord] = []
    in_flight: list[ClientRecord] = []
    skipped: list[float] = []
    over = anyio.Event()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as client:

        async def send_long(spec: RequestSpec, record: ClientRecord) -> None:
            try:
                await send_one(client, spec, record)
            finally:
                in_flight.remove(record)

        async def feed(group: anyio.abc.TaskGroup) -> None:
            ticks = 0
            while not over.is_set():
                if len(in_flight) < work.long_inflight:
                    spec = RequestSpec(0.0, prompts(work.long_tokens), 1, work.long_max_tokens)
                    record = ClientRecord(sent=time.perf_counter())
                    long_records.append(record)
                    in_flight.append(record)
                    group.start_soon(send_long, spec, record)
                else:
                    skipped.append(time.perf_counter())
                ticks += 1
                with anyio.move_on_after(start + ticks / work.rate - time.perf_counter()):
                    await over.wait()

        start, start_ts = time.perf_counter(), time.time()
        with anyio.fail_after(ROUND_TIMEOUT_S):
            async with anyio.create_task_group() as outer:
                if loaded:
                    outer.start_soon(feed, outer)
                    await anyio.sleep(1.0 / work.rate)
                async with anyio.create_task_group() as inner:
                    for spec in streams:
                        record = ClientRecord(sent=time.perf_counter())
                        stream_records.append(record)
                        inner.start_soon(send_one, client, spec, record)
                over.set()
                window = time.perf_counter() - start
    return Round(stream_records, long_records, len(skipped), window, start_ts, time.time())


def _quantiles(samples: Sequence[float]) -> dict[str, Any]:
    if not samples:
        return {"p50_s": float("nan"), "p99_s": float("nan"), "samples": 0}
    p50, p99 = np.quantile(samples, [0.5, 0.99], method=SAMPLE_QUANTILE)
    return {"p50_s": float(p50), "p99_s": float(p99), "samples": len(samples)}


def _summary(rounds: list[Round]) -> dict[str, Any]:
    records = [r for rnd in rounds for r in rnd.streams]
    longs = [r for rnd in rounds for r in rnd.longs]
    done = [r for r in records if r.ok]
    row = _quantiles([g for r in done for g in r.itls_s])
    row["streams_ok"] = len(done)
    row["streams"] = len(records)
    row["output_tokens"] = sum(r.completion_tokens for r in done)
    row["errors"] = sorted({r.error for r in records + longs if r.error})[:5]
    if longs:
        finished = [r for r in longs if r.ok]
        row["long_sent"] = len(longs)
        row["long_skipped"] = sum(rnd.skipped for rnd in rounds)
        window = sum(rnd.window_s for rnd in rounds)
        row["long_rate_achieved"] = len(longs) / window
        row["long_ok"] = len(finished)
        row["long_prompt_tokens_mean"] = (
            statistics.mean(r.prompt_tokens for r in finished) if finished else 0.0
        )
        row["long_ttft_p50_s"] = _quantiles([r.ttft_s for r in finished])["p50_s"]
    return row


def measure(
    work: Workload, logs: Path, seed: int = 0, step_logs: bool = False, pinned: bool = False
) -> dict[str, dict[str, Any]]:
    """Per layout (``unpinned``; with ``pinned`` also ``pinned``, :func:`pin_plan`) and
    setup, the decode streams' ITL quantiles without and with load and their ratios,
    and each process's CPU (:func:`_cpu`); with ``step_logs``, the decode engine's steps
    (:mod:`_disagg_steps`). The same processes serve both layouts (re-pinned before each
    round; without ``pinned`` no affinity is touched), and the rounds alternate layout,
    setup and workload (module docstring)."""
    prompts = Prompts(seed)
    everywhere = sorted(os.sched_getaffinity(0)) if pinned else []
    plans: dict[str, dict[str, list[int]]] = {"unpinned": {}}  # a name not in it: everywhere
    if pinned:
        plans["pinned"] = pin_plan(everywhere)
    runs: dict[tuple[str, str, str], list[Round]] = {
        (lay, s, m): [] for lay in plans for s in SETUPS for m in MODES
    }
    with contextlib.ExitStack() as stack:
        setups = {
            setup: stack.enter_context(running(setup, work.threads, logs, step_logs))
            for setup in SETUPS
        }
        pids = {f"{s}.{role}": pid for s, r in setups.items() for role, pid in r.pids.items()}
        warm = attrs.evolve(work, streams=1, stream_tokens=8, rate=10.0)
        for started in setups.values():
            anyio.run(run_round, started.url, warm, prompts, True)  # the handshake
        pids["client"] = os.getpid()
        for _ in range(work.rounds):
            for layout, plan in plans.items():
                for name, pid in pids.items():
                    if pinned and name != "client":
                        pin(pid, plan.get(name, everywhere))
                for setup, started in setups.items():
                    if pinned:
                        pin(os.getpid(), plan.get(f"{setup}.client", everywhere))
                    for mode in MODES:
                        t0, before = time.monotonic(), snapshots(pids)
                        rnd = anyio.run(run_round, started.url, work, prompts, mode == "loaded")
                        t1, after = time.monotonic(), snapshots(pids)
                        cpu = {n: since(before[n], after[n]) for n in pids}
                        rnd = attrs.evolve(rnd, cpu=cpu, cpu_window_s=t1 - t0)
                        runs[layout, setup, mode].append(rnd)
                        time.sleep(0.2)
        if pinned:
            pin(os.getpid(), everywhere)
    result: dict[str, dict[str, Any]] = {}
    for layout in plans:
        result[layout] = {"cpus": plans[layout]} if layout == "pinned" else {}
        for setup in SETUPS:
            rounds = {mode: runs[layout, setup, mode] for mode in MODES}
            result[layout][setup] = row = _row(rounds)
            if step_logs:
                import _disagg_steps

                log = setups[setup].step_logs["colocated" if setup == "colocated" else "consumer"]
                row["decode_steps"] = {
                    mode: _disagg_steps.summarize(log, rounds[mode]) for mode in MODES
                }
    return result


def _row(rounds: dict[str, list[Round]]) -> dict[str, Any]:
    no_load, loaded = _summary(rounds["no_load"]), _summary(rounds["loaded"])
    return {
        "no_load": no_load,
        "loaded": loaded,
        "p50_loaded_vs_no_load": loaded["p50_s"] / no_load["p50_s"],
        "p99_loaded_vs_no_load": loaded["p99_s"] / no_load["p99_s"],
        "cpu": {mode: _cpu(rounds[mode]) for mode in MODES},
    }


def _cpu(rounds: list[Round]) -> dict[str, dict[str, float]]:
    """Per process, the share of a core it ran and the share its threads waited for
    one, over these rounds' windows (every process of both setups: the idle setup's
    show what it costs beside the measured one)."""
    window_ns = sum(r.cpu_window_s for r in rounds) * 1e9
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0].cpu:
        total = sum((r.cpu[name] for r in rounds), CpuTimes())
        out[name] = {
            "run": round(total.run_ns / window_ns, 3),
            "wait": round(total.wait_ns / window_ns, 3),
        }
    return out
