"""Part 1 of ``benchmarks/disagg.py``: NIXL READ bandwidth against ``memcpy``.

The producer is :mod:`_disagg_peer` in its own process (a KV cache of the model's shape
under a :class:`~connectors.nixl.agent.KVAgent`, its info served on the side channel);
this process is the consumer: a ``KVAgent`` over a cache of the same shape, admitted to
the producer through :func:`~connectors.nixl.handshake.fetch_peer_info`, reading with
:meth:`KVAgent.start_read` (one descriptor per layer, K/V and run of blocks consecutive
on both sides, built anew for every read, as the connector does) and
:meth:`KVAgent.poll` in a busy loop until done. The blocks are those the connector reads
for a prompt: every full block but the last prompt token's. ``memcpy`` is ``torch``
``copy_`` of the same blocks between two caches of the same shape in this process,
gathered the same way (one ``copy_`` per layer and run of consecutive block ids, K and V
together).
``start_read_share`` is the part of a read spent inside ``start_read`` (on host memory
UCX may copy everything before ``transfer()`` returns: then it is about 100%; the
connector posts reads on a thread of their own, so its event loop is not blocked).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from _disagg_peer import FINGERPRINT, layer_fill
from _serve_client import ROOT

PEER = Path(__file__).parent / "_disagg_peer.py"
SEED = 7


@attrs.frozen
class KVShape:
    """One rank's paged KV cache: ``layers`` tensors ``[2, blocks, block_size, kv_heads,
    head_dim]`` of float32 (the benchmark's models run in float32 on CPU)."""

    layers: int
    block_size: int
    kv_heads: int
    head_dim: int

    def cache(self, blocks: int) -> tuple[int, ...]:
        return (2, blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of all layers, K and V (float32)."""
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * 4


@contextlib.contextmanager
def producer(shape: KVShape, blocks: int, timeout_s: float = 60.0) -> Iterator[int]:
    """Start :mod:`_disagg_peer`; yield its side-channel port; close its stdin on exit
    (it closes its agent and exits), killing it if it has not within 10 s."""
    argv = [shape.layers, blocks, shape.block_size, shape.kv_heads, shape.head_dim, SEED]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(
        [sys.executable, str(PEER), *map(str, argv)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    try:
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        for line in process.stdout:  # NIXL logs to stdout too
            if line.startswith("PORT "):
                yield int(line.split()[1])
                break
            seen.append(line)
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError(f"producer exited with {process.wait()}: {''.join(seen)[-2000:]}")
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def runs(remote: Sequence[int], local: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(remote start, local start, length)`` of consecutive ids in both lists."""
    out: list[tuple[int, int, int]] = []
    for r, loc in zip(remote, local, strict=True):
        if out and out[-1][0] + out[-1][2] == r and out[-1][1] + out[-1][2] == loc:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, loc, 1))
    return out


def _median_time(fn: Callable[[], None], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def measure(shape: KVShape, prompt_len: int, repeats: int) -> dict[str, Any]:
    """Median GB/s of a NIXL READ of a ``prompt_len`` prompt's blocks from the producer
    process, and of ``copy_`` of the same blocks here; the data read is checked once."""
    from connectors.nixl.agent import KVAgent, _runs
    from connectors.nixl.handshake import fetch_peer_info
    from connectors.nixl.hugepages import back_with_huge_pages
    from connectors.nixl.transfer_key import TransferKey

    count = (prompt_len - 1) // shape.block_size  # what the connector reads
    blocks = count + 1
    remote = list(range(count))  # a fresh producer's blocks, into the consumer's 1..count
    local = [b + 1 for b in remote]
    nbytes = count * shape.block_bytes
    caches = [torch.zeros(shape.cache(blocks)) for _ in range(shape.layers)]
    agent = KVAgent(
        engine_id="disagg-bench-consumer",
        fingerprint=FINGERPRINT,
        block_size=shape.block_size,
        tp_rank=0,
        tp_size=1,
        kv_caches=caches,
    )
    try:
        with producer(shape, blocks) as port:
            info = fetch_peer_info("127.0.0.1", port, 10.0, key=TransferKey.default())
            agent.add_peer(info)

            posts: list[float] = []

            def read() -> None:
                start = time.perf_counter()
                handle = agent.start_read(info.engine_id, remote, local, b"bench", 60.0)
                posts.append(time.perf_counter() - start)
                while not agent.poll(handle):
                    pass

            t_read, read_times = _median_time(read, repeats)
            del posts[0]  # the warm-up's
        sources = [layer_fill(shape.cache(blocks), SEED, layer) for layer in range(shape.layers)]
        correct = all(
            torch.equal(dst[:, 1 : count + 1], src[:, :count])
            for dst, src in zip(caches, sources, strict=True)
        )
        read_huge = agent.huge_page_bytes
    finally:
        agent.close()
    targets = [torch.zeros_like(s) for s in sources]
    memcpy_huge = back_with_huge_pages(sources + targets)  # as the agents' caches are
    copy_runs = runs(remote, local)

    def memcpy() -> None:
        for dst, src in zip(targets, sources, strict=True):
            for r, loc, n in copy_runs:
                dst[:, loc : loc + n].copy_(src[:, r : r + n])

    t_copy, copy_times = _median_time(memcpy, repeats)
    return {
        "prompt_len": prompt_len,
        "blocks": count,
        "bytes": nbytes,
        "descriptors_per_read": 2 * shape.layers * len(_runs(remote, local)[2]),
        "repeats": repeats,
        "nixl_read_GBps": nbytes / t_read / 1e9,
        "memcpy_GBps": nbytes / t_copy / 1e9,
        "nixl_vs_memcpy": t_copy / t_read,
        "start_read_share": statistics.median(posts) / t_read,
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "huge_page_share_read": read_huge / (2 * len(caches) * caches[0][0].nbytes),
        "huge_page_share_memcpy": memcpy_huge / (2 * len(sources) * sources[0].nbytes),
        "read_correct": correct,
        "raw_read_s": read_times,
        "raw_memcpy_s": copy_times,
    }
