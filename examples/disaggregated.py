"""Disaggregated prefill/decode on loopback: a producer, a consumer and ``kvstep proxy``.

Starts four servers (needs ``kvstep[nixl]``)::

    kvstep serve --kv-role producer --connector-options '{"port": S1}'   # prefill
    kvstep serve --kv-role consumer --connector-options '{"port": S2}'   # decode
    kvstep proxy --prefill http://PRODUCER --decode http://CONSUMER
    kvstep serve                                                         # reference

sends greedy completions through the proxy with the ``openai`` client, all in flight at
once, checks they equal the plain single-engine reference server's, and that the
consumer loaded the prompts' KV over the connector (its ``kvstep_kv_loaded_tokens``
counter) instead of computing it (its ``kvstep_scheduled_tokens``). The issue's
acceptance run, with both sides split over two worker processes::

    python examples/disaggregated.py --requests 32 --min-prompt 16 --max-prompt 2000 \\
        --world-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai

MODEL = "builtin:tiny"
BLOCK_SIZE = 16  # kvstep serve's default --block-size
ENGINES = ("producer", "consumer", "reference")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A loopback port ``p`` with ``p .. p + count - 1`` free (rank r serves on p + r),
    below the kernel's ephemeral range: a port found by binding port 0 may be handed to
    another connection on this machine before the server binds it."""
    low = 32_768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(10_000, max(10_001, low - count))
        if all(_bindable(p) for p in range(port, port + count)):
            return port


class Cluster:
    """The running processes: their URLs, and their logs (for error messages)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.urls: dict[str, str] = {}
        self.commands: dict[str, tuple[str, ...]] = {}

    def start(self, name: str, command: str, *flags: str) -> None:
        self.commands[name] = (command, *flags)
        port = free_port()
        argv = [sys.executable, "-m", "pipeline.cli", command, "--host", "127.0.0.1"]
        # One thread of torch each: the processes share this machine's cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with (self.logs / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                [*argv, "--port", str(port), *flags],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.urls[name] = f"http://127.0.0.1:{port}"

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def wait_healthy(self, names: Sequence[str], timeout_s: float = 180.0) -> None:
        """Wait for each process's ``/health``; one whose free port was taken meanwhile
        (by another process on this machine) is started again on a new one."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            retries = 3
            while True:
                if self.processes[name].poll() is not None:
                    if retries and "address already in use" in self.log(name).lower():
                        retries -= 1
                        self.start(name, *self.commands[name])
                        continue
                    raise RuntimeError(f"{name} exited: {self.log(name)}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.urls[name]}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come up: {self.log(name)}")
                time.sleep(0.2)

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.processes.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def serve_flags(max_model_len: int) -> list[str]:
    return ["--model", MODEL, "--dtype", "float32", "--max-model-len", str(max_model_len)]


@contextlib.contextmanager
def cluster(
    logs: Path, world_size: int = 1, max_model_len: int = 1024, reference: str | None = None
) -> Iterator[Cluster]:
    """Producer, consumer (``world_size`` worker processes each when above 1), the
    proxy and a single-engine reference server (unless ``reference`` is the URL of a
    running one), all healthy; stopped on exit."""
    serve = serve_flags(max_model_len)
    split = ["--executor", "multiproc", "--world-size", str(world_size)]
    procs = Cluster(logs)
    try:
        for name in ("producer", "consumer"):
            side_channel = json.dumps({"host": "127.0.0.1", "port": free_port(world_size)})
            procs.start(name, "serve", *serve, *(split if world_size > 1 else []),
                        "--kv-role", name, "--connector-options", side_channel)  # fmt: skip
        if reference is None:
            procs.start("reference", "serve", *serve)
        else:
            procs.urls["reference"] = reference
        procs.wait_healthy(list(procs.processes))  # their URLs are final from here on
        procs.start("proxy", "proxy", "--prefill", procs.urls["producer"],
                    "--decode", procs.urls["consumer"], "--health-interval", "0.5")  # fmt: skip
        # The proxy's /health is 200 once it has seen both of its backends healthy.
        procs.wait_healthy(["proxy"])
        yield procs
    finally:
        procs.stop()


@contextlib.contextmanager
def reference_server(logs: Path, max_model_len: int = 1024) -> Iterator[Cluster]:
    """A plain single-engine server alone (for several clusters to compare with)."""
    procs = Cluster(logs)
    try:
        procs.start("reference", "serve", *serve_flags(max_model_len))
        procs.wait_healthy(["reference"])
        yield procs
    finally:
        procs.stop()


def counter(url: str, name: str) -> float:
    """A counter of the server's ``/metrics`` (``kvstep_scheduled_tokens``, ...)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.split()[1])
    raise RuntimeError(f"no {name}_total in /metrics")


def scheduled(procs: Cluster) -> dict[str, float]:
    """Tokens each engine computed so far (its ``kvstep_scheduled_tokens`` counter)."""
    return {n: counter(procs.urls[n], "kvstep_scheduled_tokens") for n in ENGINES}


def loaded(procs: Cluster) -> float:
    """Tokens the consumer loaded over the connector so far."""
    return counter(procs.urls["consumer"], "kvstep_kv_loaded_tokens")


def full_blocks(prompt_len: int) -> int:
    """Prompt tokens a consumer reads: every whole block but the last prompt token's."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def make_prompts(count: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    """``count`` token-id prompts, lengths evenly spread over ``shortest..longest``."""
    rng = random.Random(seed)
    steps = max(count - 1, 1)
    lengths = [shortest + (longest - shortest) * i // steps for i in range(count)]
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


async def _complete(url: str, prompt: list[int], max_tokens: int, stream: bool) -> list[int]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    async with client:
        if not stream:
            answer = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                extra_body=extra, timeout=600,
            )  # fmt: skip
            return list(getattr(answer.choices[0], "token_ids", None) or [])
        chunks = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            extra_body=extra, timeout=600, stream=True,
        )  # fmt: skip
        ids: list[int] = []
        async for chunk in chunks:
            for choice in chunk.choices:
                ids += getattr(choice, "token_ids", None) or []
        return ids


def generate(
    url: str, prompts: list[list[int]], max_tokens: int = 8, stream: bool = False
) -> list[list[int]]:
    """Greedy token ids of every prompt from the server at ``url``, all in flight at once."""

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(_complete(url, p, max_tokens, stream) for p in prompts)))

    return asyncio.run(run())


def check(
    procs: Cluster, prompts: list[list[int]], max_tokens: int = 8, stream: bool = False
) -> dict[str, float]:
    """Send ``prompts`` through the proxy and to the reference; assert equal tokens, and
    that the consumer loaded exactly the prompts' whole blocks instead of computing them.
    Returns what each engine computed, what the consumer loaded and the wall times."""
    before, loaded_before = scheduled(procs), loaded(procs)
    start = time.monotonic()
    proxied = generate(procs.urls["proxy"], prompts, max_tokens, stream)
    proxy_s = time.monotonic() - start
    reference = generate(procs.urls["reference"], prompts, max_tokens, stream)
    after, loaded_after = scheduled(procs), loaded(procs)
    assert [len(t) for t in proxied] == [max_tokens] * len(prompts), proxied
    bad = [i for i, (a, b) in enumerate(zip(proxied, reference, strict=True)) if a != b]
    assert not bad, f"proxy != single engine for prompts {bad}: {proxied} != {reference}"
    result = {f"computed_{n}": after[n] - before[n] for n in ENGINES}
    result["loaded_consumer"] = loaded_after - loaded_before
    result["proxy_wall_s"] = proxy_s
    expected = sum(full_blocks(len(p)) for p in prompts)
    why = f"{result}, {expected} expected: {procs.log('consumer')}"
    # The consumer read every whole prompt block over the connector ...
    assert result["loaded_consumer"] == expected, why
    # ... and computed the same tokens as the reference engine but those.
    assert result["computed_reference"] - result["computed_consumer"] == expected, why
    assert all(procs.alive().values()), procs.alive()
    return result


def main(argv: Sequence[str] = ()) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3, help="concurrent requests")
    parser.add_argument("--min-prompt", type=int, default=5, help="shortest prompt (tokens)")
    parser.add_argument("--max-prompt", type=int, default=100, help="longest prompt (tokens)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated each")
    parser.add_argument("--world-size", type=int, default=1, help="worker processes each side")
    parser.add_argument("--stream", action="store_true", help="stream the completions")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("nixl_cu12") is None:
        print("nixl is not installed (pip install 'kvstep[nixl]'); nothing to show")
        return {"skipped": 1.0}
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt)
    max_model_len = max(1024, args.max_prompt + args.max_tokens)
    start = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as logs,
        cluster(Path(logs), args.world_size, max_model_len) as procs,
    ):
        result = {"startup_s": time.monotonic() - start}
        result |= check(procs, prompts, args.max_tokens, args.stream)
    result["wall_s"] = time.monotonic() - start
    lengths = [len(p) for p in prompts]
    print(
        f"{len(prompts)} requests, prompts of {min(lengths)}..{max(lengths)} tokens "
        f"({sum(lengths)} in all), world_size {args.world_size}: proxy == single engine"
    )
    print(
        f"consumer: computed {result['computed_consumer']:.0f} tokens, loaded "
        f"{result['loaded_consumer']:.0f} over nixl; producer computed "
        f"{result['computed_producer']:.0f}, reference {result['computed_reference']:.0f}"
    )
    print(
        f"servers up in {result['startup_s']:.1f} s, proxied requests took "
        f"{result['proxy_wall_s']:.1f} s, in all {result['wall_s']:.1f} s"
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
