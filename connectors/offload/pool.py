"""``HostKVPool``: the worker half's slots in host memory, and the copies in and out.

Per layer one tensor ``[num_slots, 2, block_size, kv_heads, head_dim]`` (a slot is one
contiguous chunk per layer; pinned when the paged cache is on CUDA), plus per slot the
key it was written for and, optionally, per slot and layer a checksum. Copies go by
*runs*: consecutive slots to consecutive blocks become one strided ``copy_`` (a single
pass over the bytes, no gather buffer), so a request whose blocks were stored together
loads in a handful of copies.

Thread-safety: a copy touches only the slots and blocks it names, and the scheduler
never gives one slot to a load and a save at once, so the loader thread and the forward
thread may copy concurrently. Keys and checksums are written on the event loop only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from pipeline.errors import InvalidConfigError

__all__ = ["CopyRun", "HostKVPool", "make_runs"]


class CopyRun(NamedTuple):
    """Slots ``slot .. slot+length-1`` ↔ blocks ``block .. block+length-1``.

    ``req_ids`` are the requests whose blocks the run holds (a failed save fails them).
    """

    slot: int
    block: int
    length: int
    req_ids: frozenset[str] = frozenset()


def make_runs(pairs: Iterable[tuple[int, int, str]]) -> list[CopyRun]:
    """Coalesce ``(slot, block, req_id)`` triples into runs of consecutive slots and
    blocks, in the given order."""
    runs: list[CopyRun] = []
    for slot, block, req_id in pairs:
        if runs:
            last = runs[-1]
            if slot == last.slot + last.length and block == last.block + last.length:
                runs[-1] = last._replace(length=last.length + 1, req_ids=last.req_ids | {req_id})
                continue
        runs.append(CopyRun(slot, block, 1, frozenset({req_id})))
    return runs


def run_blocks(runs: Iterable[CopyRun]) -> set[int]:
    """Every block id the runs cover."""
    return {run.block + i for run in runs for i in range(run.length)}


class HostKVPool:
    """The host-memory tier of one rank.

    Args:
        layers: One ``[num_slots, 2, block_size, kv_heads, head_dim]`` tensor per layer.
        checksums: Keep per-slot, per-layer checksums (see :meth:`record_checksums`).
    """

    def __init__(self, layers: Sequence[torch.Tensor], *, checksums: bool = False) -> None:
        self.layers = list(layers)
        self.num_slots = self.layers[0].shape[0]
        self.keys: list[bytes | None] = [None] * self.num_slots
        self.sums: torch.Tensor | None = None
        if checksums:
            self.sums = torch.zeros(len(self.layers), self.num_slots, dtype=torch.int64)

    @classmethod
    def allocate(
        cls, kv_caches: Sequence[torch.Tensor], num_slots: int, *, checksums: bool = False
    ) -> HostKVPool:
        """A pool shaped like ``kv_caches`` (``[2, num_blocks, block_size, heads, dim]``
        per layer), pinned when they are on CUDA. Blocks while it allocates.

        Raises:
            InvalidConfigError: No layers, or a layer of another shape or dtype.
        """
        if not kv_caches:
            raise InvalidConfigError("kv_caches", kv_caches, "offload needs at least one layer")
        first = kv_caches[0]
        for kv in kv_caches:
            if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape != first.shape:
                raise InvalidConfigError(
                    "kv_caches",
                    tuple(kv.shape),
                    "every layer must be [2, num_blocks, block_size, kv_heads, head_dim] "
                    f"like layer 0 {tuple(first.shape)}",
                )
        shape = (num_slots, 2, *first.shape[2:])
        pin = first.device.type == "cuda"
        layers = [
            torch.zeros(shape, dtype=first.dtype, device="cpu", pin_memory=pin) for _ in kv_caches
        ]
        return cls(layers, checksums=checksums)

    @property
    def block_bytes(self) -> int:
        """Bytes of one slot over all layers (what one block of KV takes)."""
        layer = self.layers[0]
        return layer[0].numel() * layer.element_size() * len(self.layers)

    def load_layer(self, layer: int, kv: torch.Tensor, runs: Sequence[CopyRun]) -> None:
        """Copy each run's slots of ``layer`` into its blocks of ``kv`` (the paged cache
        layer). Blocks the calling thread on CPU; only queues the copy on CUDA."""
        src = self.layers[layer]
        non_blocking = kv.device.type == "cuda"
        for run in runs:
            part = src[run.slot : run.slot + run.length].transpose(0, 1)
            kv[:, run.block : run.block + run.length].copy_(part, non_blocking=non_blocking)

    def save_layer(self, layer: int, kv: torch.Tensor, runs: Sequence[CopyRun]) -> None:
        """Copy each run's blocks of ``kv`` into its slots of ``layer``. Blocks the
        calling thread on CPU; only queues the copy on CUDA (pinned destination)."""
        dst = self.layers[layer]
        non_blocking = kv.device.type == "cuda"
        for run in runs:
            part = kv[:, run.block : run.block + run.length].transpose(0, 1)
            dst[run.slot : run.slot + run.length].copy_(part, non_blocking=non_blocking)

    def _sums(self, layer: int, run: CopyRun) -> torch.Tensor:
        chunk = self.layers[layer][run.slot : run.slot + run.length].reshape(run.length, -1)
        words = chunk.view(torch.int32) if chunk.shape[1] * chunk.element_size() % 4 == 0 else chunk
        return words.sum(dim=1, dtype=torch.int64)

    def record_checksums(self, runs: Sequence[CopyRun]) -> None:
        """Store the checksum of every slot of ``runs`` in every layer (after the save
        completed). No-op without checksums. Blocks the calling thread."""
        if self.sums is None:
            return
        for layer in range(len(self.layers)):
            for run in runs:
                self.sums[layer, run.slot : run.slot + run.length] = self._sums(layer, run)

    def verify_layer(self, layer: int, runs: Sequence[CopyRun]) -> set[int]:
        """The blocks of ``runs`` whose slot in ``layer`` does not match its checksum
        (empty without checksums). Blocks the calling thread."""
        if self.sums is None:
            return set()
        bad: set[int] = set()
        for run in runs:
            expected = self.sums[layer, run.slot : run.slot + run.length]
            mismatch = (self._sums(layer, run) != expected).nonzero().flatten().tolist()
            bad.update(run.block + int(i) for i in mismatch)
        return bad
