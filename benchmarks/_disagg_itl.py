"""Part 3 of ``benchmarks/disagg.py``: decode ITL while long prompts keep arriving,
colocated against disaggregated.

Setups (real processes on loopback, started and stopped here; ``builtin:tiny``, float32
on CPU, each engine process with ``OMP_NUM_THREADS`` = ``threads``):

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
once (the idle one waits on its sockets) and the rounds alternate setup and workload,
``rounds`` times each, with fresh prompts every round, so a change in the machine's
load falls on all four alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import httpx
import numpy as np
from _serve_client import WORDS, ClientRecord, RequestSpec, free_port, proxy, send_one, serve
from _serve_metrics import SAMPLE_QUANTILE

MODEL = "builtin:tiny"
SERVE_ARGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "4096"]
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


# -- processes ------------------------------------------------------------------------


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """``OMP_NUM_THREADS=n`` in this process's environment (the servers started
    inside inherit it; this process's torch pool is already made)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old


@contextlib.contextmanager
def running(setup: str, threads: int, logs: Path) -> Iterator[str]:
    """The processes of ``setup``; yields the URL the workload is sent to."""
    with contextlib.ExitStack() as stack:
        with _threads(threads):
            if setup == "colocated":
                url = stack.enter_context(serve(MODEL, SERVE_ARGS, logs / "colocated.log"))
            else:
                urls = {}
                for role in ("producer", "consumer"):
                    side = json.dumps({"host": "127.0.0.1", "port": free_port()})
                    flags = [*SERVE_ARGS, "--kv-role", role, "--connector-options", side]
                    urls[role] = stack.enter_context(serve(MODEL, flags, logs / f"{role}.log"))
                flags = ["--prefill", urls["producer"], "--decode", urls["consumer"]]
                flags += ["--health-interval", "0.5"]
                url = stack.enter_context(proxy(flags, logs / "proxy.log"))
        yield url


# -- the workload ---------------------------------------------------------------------


class Prompts:
    """Random-word prompts of about a given number of ``builtin:tiny`` tokens: the word
    count for a length is fitted once with the tokenizer, so a prompt made while a
    round is timed costs only the random choice (usage reports the real counts)."""

    def __init__(self, seed: int) -> None:
        from pipeline.tokenizer import load_tokenizer
        from stages.forward.builtin import tokenizer_dir

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
    no prompt was sent because ``long_inflight`` were unanswered, and the time from the
    round's start to its streams' end."""

    streams: list[ClientRecord]
    longs: list[ClientRecord]
    skipped: int
    window_s: float


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

        start = time.perf_counter()
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
    return Round(stream_records, long_records, len(skipped), window)


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


def measure(work: Workload, logs: Path, seed: int = 0) -> dict[str, Any]:
    """Per setup, the decode streams' ITL quantiles without and with load and their
    ratios (the order of the rounds: see the module docstring)."""
    prompts = Prompts(seed)
    runs: dict[tuple[str, str], list[Round]] = {(s, m): [] for s in SETUPS for m in MODES}
    with contextlib.ExitStack() as stack:
        urls = {setup: stack.enter_context(running(setup, work.threads, logs)) for setup in SETUPS}
        warm = attrs.evolve(work, streams=1, stream_tokens=8, rate=10.0)
        for url in urls.values():
            anyio.run(run_round, url, warm, prompts, True)  # first requests, the handshake
        for _ in range(work.rounds):
            for setup, url in urls.items():
                for mode in MODES:
                    runs[setup, mode].append(
                        anyio.run(run_round, url, work, prompts, mode == "loaded")
                    )
                    time.sleep(0.2)
    result: dict[str, Any] = {}
    for setup in SETUPS:
        no_load, loaded = _summary(runs[setup, "no_load"]), _summary(runs[setup, "loaded"])
        result[setup] = {
            "no_load": no_load,
            "loaded": loaded,
            "p50_loaded_vs_no_load": loaded["p50_s"] / no_load["p50_s"],
            "p99_loaded_vs_no_load": loaded["p99_s"] / no_load["p99_s"],
        }
    return result
