"""The serving benchmark's client side: ``kvstep serve`` (and ``kvstep proxy``)
processes started from this repository, the seeded Poisson workload of shared-prefix
prompts, and the streaming client that times each request (see ``benchmarks/serve.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import anyio
import attrs
import httpx

ROOT = Path(__file__).resolve().parent.parent

# Plain English words the builtin tokenizer knows well (it was trained on such text).
_VOCABULARY = (
    "the a of and to in is it that for on with as was he she they we you this be at by "
    "from or an but not what all were when your can said there use each which do how "
    "their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "model token cache block prompt request server reply bread river town morning sea "
    "green bird tree spring story question answer kind brief correct light small warm"
)
WORDS = tuple(_VOCABULARY.split())


# -- the server ---------------------------------------------------------------------------


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (a port found by binding
    port 0 may be handed to another connection before the server binds it)."""
    low = 32_768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment plus ``extra``, with this repository on ``PYTHONPATH``."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@attrs.frozen
class Launched:
    """A ``python -m pipeline.cli`` process started by :func:`launch`.

    Attributes:
        url: Its base URL (``http://127.0.0.1:PORT``).
        process: The process.
        log: Its stdout and stderr.
    """

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def wait_healthy(self, deadline: float) -> None:
        """Return once ``/health`` answers 200; ``RuntimeError`` (with the log's tail)
        when the process exits first or ``deadline`` (``time.monotonic``) passes."""
        while True:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.url} exited with {self.process.returncode}:\n{tail}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.url} did not come up in time:\n{tail}")
            time.sleep(0.2)


@contextlib.contextmanager
def launch(
    command: str,
    flags: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    program: Sequence[str] = (),
) -> Iterator[Launched]:
    """Start ``python -m pipeline.cli COMMAND --host 127.0.0.1 --port PORT FLAGS`` (a
    free port) from this repository, output to ``log``, ``env`` added to this process's
    environment; yields at once (see :meth:`Launched.wait_healthy`). Terminated (then
    killed after 30 s) on exit, whatever happened. ``program``: what runs instead of
    ``python -m pipeline.cli`` (a script with the CLI's arguments)."""
    port = free_port()
    head = list(program) or [sys.executable, "-m", "pipeline.cli"]
    cmd = [*head, command, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(env)
        )
        try:
            yield Launched(f"http://127.0.0.1:{port}", process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def serve(
    model: str,
    extra: Sequence[str],
    log: Path,
    timeout_s: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Start ``kvstep serve`` from this repository, wait for ``/health``; yield its URL.

    The process is terminated (then killed after 30 s) on exit, whatever happened.
    """
    with launch("serve", ["--model", model, *extra], log, env) as server:
        server.wait_healthy(time.monotonic() + timeout_s)
        yield server.url


@contextlib.contextmanager
def proxy(
    flags: Sequence[str],
    log: Path,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """``kvstep proxy`` with ``flags`` (its backends and policy); yields its URL once its
    ``/health`` is 200 (it has seen a healthy backend in each pool); stopped on exit."""
    with launch("proxy", flags, log, env) as started:
        started.wait_healthy(time.monotonic() + timeout_s)
        yield started.url


# -- the workload -------------------------------------------------------------------------


@attrs.frozen
class RequestSpec:
    """One request of the workload.

    Attributes:
        send_at_s: When to send it, seconds after the workload starts.
        prompt: The prompt text (a shared prefix + a unique suffix).
        prefix: Which shared prefix it starts with.
        max_tokens: Tokens to generate (``ignore_eos``: exactly this many).
    """

    send_at_s: float
    prompt: str
    prefix: int
    max_tokens: int


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_workload(args: argparse.Namespace, count: int, seed: int) -> list[RequestSpec]:
    """``count`` requests with Poisson send times (seeded, same for the same flags)."""
    rng = random.Random(seed)
    prefixes = [
        _words(rng, rng.randint(*args.prefix_words)) + "." for _ in range(args.num_prefixes)
    ]
    specs = []
    at = 0.0
    for _ in range(count):
        at += rng.expovariate(args.request_rate)
        which = rng.randrange(len(prefixes))
        suffix = _words(rng, rng.randint(*args.suffix_words))
        specs.append(
            RequestSpec(at, f"{prefixes[which]} {suffix}", which, rng.randint(*args.output_tokens))
        )
    return specs


@attrs.define
class ClientRecord:
    """What the client saw of one request (``perf_counter`` seconds).

    Attributes:
        sent: When the request was sent.
        chunk_times: Arrival time of each chunk that carried tokens.
        chunk_tokens: Tokens in each of those chunks.
        ended: When the stream ended (``[DONE]`` read), or ``None``.
        prompt_tokens: From the final ``usage`` chunk.
        completion_tokens: From the final ``usage`` chunk.
        error: Why the request failed, or ``None``.
    """

    sent: float
    chunk_times: list[float] = attrs.field(factory=list)
    chunk_tokens: list[int] = attrs.field(factory=list)
    ended: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended is not None and bool(self.chunk_times)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e_s(self) -> float:
        assert self.ended is not None
        return self.ended - self.sent

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


async def send_one(client: httpx.AsyncClient, spec: RequestSpec, record: ClientRecord) -> None:
    """Stream one completion into ``record``; a failure is recorded, never raised."""
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    record.ended = now
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return
                tokens = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
                if tokens:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(tokens)
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


@attrs.frozen
class WorkloadRun:
    """What :func:`run_workload` saw.

    Attributes:
        records: One per request, in the order sent.
        started: ``perf_counter`` time the workload started (send times count from it).
    """

    records: list[ClientRecord]
    started: float


async def run_workload(url: str, specs: Sequence[RequestSpec]) -> WorkloadRun:
    """Send each request at its time, not waiting for earlier ones to finish; return
    when every request has finished or failed."""
    records: list[ClientRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for spec in specs:
                delay = start + spec.send_at_s - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                record = ClientRecord(sent=time.perf_counter())
                records.append(record)
                tg.start_soon(send_one, client, spec, record)
    return WorkloadRun(records, start)
