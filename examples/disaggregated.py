"""Disaggregated prefill/decode on loopback: a producer, a consumer and ``kvstep proxy``.

Starts four processes (needs ``kvstep[nixl]``)::

    kvstep serve --kv-role producer --connector-options '{"port": S1}'   # prefill
    kvstep serve --kv-role consumer --connector-options '{"port": S2}'   # decode
    kvstep proxy --prefill http://PRODUCER --decode http://CONSUMER
    kvstep serve                                                         # reference

sends greedy completions through the proxy with the ``openai`` client, checks they
equal the plain reference server's, and that the consumer loaded the prompts' KV over
the connector (its ``kvstep_kv_loaded_tokens`` counter) instead of computing it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
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
SERVE = ["--model", MODEL, "--dtype", "float32", "--max-model-len", "1024"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """The running processes: their URLs, and their logs (for error messages)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.urls: dict[str, str] = {}

    def start(self, name: str, command: str, *flags: str) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "pipeline.cli", command, "--host", "127.0.0.1"]
        # One thread of torch each: the four processes share this machine's cores.
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        with (self.logs / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                [*argv, "--port", str(port), *flags],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.urls[name] = f"http://127.0.0.1:{port}"

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def wait_healthy(self, names: Sequence[str], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while True:
                if self.processes[name].poll() is not None:
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


@contextlib.contextmanager
def cluster(logs: Path) -> Iterator[Cluster]:
    """Producer, consumer, reference server and the proxy, all healthy; stopped on exit."""
    procs = Cluster(logs)
    try:
        for name, role in (("producer", "producer"), ("consumer", "consumer")):
            side_channel = json.dumps({"host": "127.0.0.1", "port": free_port()})
            procs.start(name, "serve", *SERVE, "--kv-role", role,
                        "--connector-options", side_channel)  # fmt: skip
        procs.start("reference", "serve", *SERVE)
        procs.start("proxy", "proxy", "--prefill", procs.urls["producer"],
                    "--decode", procs.urls["consumer"], "--health-interval", "0.5")  # fmt: skip
        # The proxy's /health is 200 once it has seen both of its backends healthy.
        procs.wait_healthy(["producer", "consumer", "reference", "proxy"])
        yield procs
    finally:
        procs.stop()


def counter(url: str, name: str) -> float:
    """A counter of the server's ``/metrics`` (``kvstep_scheduled_tokens``, ...)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.split()[1])
    raise RuntimeError(f"no {name}_total in /metrics")


def scheduled(procs: Cluster) -> dict[str, float]:
    """Tokens each engine computed so far (its ``kvstep_scheduled_tokens`` counter)."""
    return {n: counter(procs.urls[n], "kvstep_scheduled_tokens") for n in ENGINES}


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[str, list[int]]:
    """One greedy completion (the text and its token ids) from the server at ``url``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = answer.choices[0]
    return choice.text, list(getattr(choice, "token_ids", None) or [])


def main() -> list[str]:
    if importlib.util.find_spec("nixl_cu12") is None:
        print("nixl is not installed (pip install 'kvstep[nixl]'); nothing to show")
        return ["skipped: no nixl"]
    # Token-id prompts of 5, 40 and 100 tokens: none, two and six full KV blocks.
    prompts = [[(7 * i + n) % 200 + 1 for i in range(n)] for n in (5, 40, 100)]
    with tempfile.TemporaryDirectory() as logs, cluster(Path(logs)) as procs:
        before = scheduled(procs)
        texts = []
        for prompt in prompts:
            text, token_ids = complete(procs.urls["proxy"], prompt)
            expected = complete(procs.urls["reference"], prompt)
            print(f"{len(prompt):4} prompt tokens -> {text!r} {token_ids}")
            assert (text, token_ids) == expected, f"proxy {token_ids} != single engine {expected}"
            texts.append(text)
        after = scheduled(procs)
        computed = {n: after[n] - before[n] for n in ENGINES}
        # The consumer computes the same tokens as the reference engine but the prompt
        # blocks it read from the producer: every full block but the last token's.
        # (kvstep_kv_loaded_tokens stays 0: the nixl worker reports no KV stats.)
        loaded = computed["reference"] - computed["consumer"]
        full_blocks = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)
        print(f"tokens computed: {computed}; read over the connector: {loaded:.0f}")
        assert loaded == full_blocks, f"{computed}, not {full_blocks}: {procs.log('consumer')}"
        assert all(procs.alive().values()), procs.alive()
    return texts


if __name__ == "__main__":
    main()
