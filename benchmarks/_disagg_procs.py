"""Part 3's processes: a setup's servers (and proxy) started on loopback, and where they
run when pinned (``benchmarks/disagg.py --pin``).

Pinned layout (:func:`pin_plan`): disaggregation's point is that prefill and decode run
on separate hardware, so the producer gets a core of its own and the consumer another.
The proxy and the client go with the consumer: they are on the decode path (the proxy
relays every decode token, the client times it) and do the same work with load and
without, so the loaded/no-load ratio still measures what the producer's prefills cost
the decode streams; on the producer's core their wake-ups would queue behind prefill
compute, a cost of this two-core box and of the measuring, not of disaggregation. The
colocated server and its client get both cores: the same total.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
from _serve_client import free_port, launch

__all__ = ["MODEL", "SERVE_ARGS", "Running", "pin_plan", "running"]

MODEL = "builtin:tiny"
SERVE_ARGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "4096"]


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


@attrs.frozen
class Running:
    """A setup's processes: the URL the workload goes to, each process's pid by role
    (``colocated``; ``producer``, ``consumer``, ``proxy``), and the step logs written."""

    url: str
    pids: dict[str, int]
    step_logs: dict[str, Path]


@contextlib.contextmanager
def running(setup: str, threads: int, logs: Path, step_logs: bool = False) -> Iterator[Running]:
    """The processes of ``setup``; yields them once all are healthy. ``step_logs``:
    each server writes its step log to ``logs/ROLE.steps.jsonl``."""
    pids: dict[str, int] = {}
    steps: dict[str, Path] = {}
    with contextlib.ExitStack() as stack:

        def start(command: str, role: str, flags: list[str], timeout_s: float) -> str:
            if command == "serve":
                flags = ["--model", MODEL, *SERVE_ARGS, *flags]
                if step_logs:
                    steps[role] = logs / f"{role}.steps.jsonl"
                    flags += ["--step-log", str(steps[role])]
            started = stack.enter_context(launch(command, flags, logs / f"{role}.log"))
            started.wait_healthy(time.monotonic() + timeout_s)
            pids[role] = started.process.pid
            return started.url

        with _threads(threads):
            if setup == "colocated":
                url = start("serve", "colocated", [], 180.0)
            else:
                urls = {}
                for role in ("producer", "consumer"):
                    side = json.dumps({"host": "127.0.0.1", "port": free_port()})
                    flags = ["--kv-role", role, "--connector-options", side]
                    urls[role] = start("serve", role, flags, 180.0)
                flags = ["--prefill", urls["producer"], "--decode", urls["consumer"]]
                url = start("proxy", "proxy", [*flags, "--health-interval", "0.5"], 60.0)
        yield Running(url, pids, steps)


def pin_plan(cpus: Sequence[int]) -> dict[str, list[int]]:
    """The pinned layout on the first two of ``cpus``: the producer alone on one; the
    consumer on the other with everything on the decode path (the proxy, and the client,
    which times the tokens); the colocated server and its client on both, the same total.

    Raises:
        ValueError: Fewer than two CPUs.
    """
    if len(cpus) < 2:
        raise ValueError(f"pinning needs two CPUs, this process may use {list(cpus)}")
    prefill, decode = cpus[0], cpus[1]
    both = [prefill, decode]
    return {
        "colocated.colocated": both,
        "colocated.client": both,
        "disaggregated.producer": [prefill],
        "disaggregated.consumer": [decode],
        "disaggregated.proxy": [decode],
        "disaggregated.client": [decode],
    }
