"""An all-reduce through shared memory, for tensor-parallel ranks on one host's CPUs.

gloo sums a decode step's ``[16, 512]`` float32 activations between two processes in
about 500 µs here (TCP over loopback, two hops), and a tensor-parallel decoder makes two
such reductions per layer. Ranks on one machine can instead meet in a shared file
mapping: each rank copies its tensor into its slot, raises its ``arrived`` counter,
waits for every other rank's, and sums the slots **in rank order**, so that every rank
gets bit-identical results (the sampled tokens must agree).

Two buffers alternate by call parity; before writing a buffer, a rank waits until every
rank has finished reading it two calls ago (its ``finished`` counter), so a fast rank
never overwrites data a slow one still reads. The counters are plain stores, ordered
after the data stores by x86's total store order: :func:`available` offers this only on
x86-64. Tensors larger than a slot go to the fallback (gloo); every rank decides alike,
since every rank reduces the same shapes.

A rank that does not arrive within ``timeout_s`` makes the others raise, like a gloo
timeout: the step fails and the group is out of step (fatal for the worker).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["SharedMemoryAllReduce", "available", "region_bytes", "slot_bytes"]

_SPIN_S = 50e-6  # busy-wait this long before yielding the core on each poll
SLOT_MAX_BYTES = 64 << 20


def slot_bytes(max_tokens: int, hidden_size: int, element_size: int) -> int:
    """A slot for a step's ``[max_tokens, hidden_size]`` activations, 64-byte aligned and
    at most ``SLOT_MAX_BYTES`` (larger reductions fall back)."""
    raw = max_tokens * hidden_size * element_size
    return min(-(-raw // 64) * 64, SLOT_MAX_BYTES)


def region_bytes(size: int, slot: int) -> int:
    """Bytes of the shared file for ``size`` ranks with ``slot``-byte slots."""
    return 2 * size * 8 + 2 * size * slot


def available() -> bool:
    """Whether this machine's memory ordering lets plain stores publish a slot (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedMemoryAllReduce:
    """In-place sum of a CPU tensor across ``size`` processes that map ``path``.

    Every rank constructs it with the same ``path``, ``size`` and ``slot_bytes`` (any
    rank may create the file; the others open it), and calls it in the same order with
    the same shapes. The file is mapped by the constructor: once every rank has
    constructed it, the name may be unlinked (the engine does, so that a killed group
    leaves no memory behind); the mappings stay shared. Not thread-safe: one call at a
    time per rank.

    Args:
        path: A file shared by the ranks (tmpfs preferred); created at the full size.
        rank: This rank.
        size: Ranks in the group.
        slot_bytes: Largest tensor (in bytes) reduced here; larger ones use ``fallback``.
        fallback: The reduce for larger or non-CPU tensors (``torch.distributed.all_reduce``).
        timeout_s: How long a rank waits for the others before raising.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        rank: int,
        size: int,
        slot_bytes: int,
        fallback: Callable[[torch.Tensor], object],
        timeout_s: float,
    ) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.fallback, self.timeout_s = fallback, timeout_s
        header = 2 * size * 8  # arrived[size], finished[size]: int64
        nbytes = region_bytes(size, slot_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        raw = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        counters = raw[:header].view(torch.int64).view(2, size)
        self._arrived, self._finished = counters[0], counters[1]
        self._data = raw[header:].view(2, size, slot_bytes)
        self._seq = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` across the ranks, in place; returns it.

        Raises:
            TimeoutError: Some rank did not arrive (or finish reading) within ``timeout_s``.
        """
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes or tensor.device.type != "cpu":
            self.fallback(tensor)
            return tensor
        self._seq += 1
        seq, buf = self._seq, self._seq % 2
        self._wait(self._finished, seq - 2, "finish reading")
        flat = tensor.contiguous().view(-1)
        slots = self._data[buf, :, :nbytes].view(tensor.dtype).view(self.size, -1)
        slots[self.rank].copy_(flat)
        self._arrived[self.rank] = seq
        self._wait(self._arrived, seq, "arrive")
        total = slots[0].clone()
        for r in range(1, self.size):
            total += slots[r]  # rank order: every rank computes the same bits
        self._finished[self.rank] = seq
        tensor.copy_(total.view_as(tensor))
        return tensor

    def _wait(self, counters: torch.Tensor, seq: int, what: str) -> None:
        if seq <= 0 or int(counters.min()) >= seq:
            return
        deadline = time.monotonic() + self.timeout_s
        spin_until = time.perf_counter() + _SPIN_S
        while int(counters.min()) < seq:
            if time.perf_counter() > spin_until:
                os.sched_yield()
                if time.monotonic() > deadline:
                    late = [r for r in range(self.size) if int(counters[r]) < seq]
                    raise TimeoutError(
                        f"shared-memory all-reduce: rank(s) {late} did not {what} "
                        f"call {seq} within {self.timeout_s}s"
                    )
