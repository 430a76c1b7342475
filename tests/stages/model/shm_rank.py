"""One rank of test_shm_allreduce.py: ``python shm_rank.py RANK SIZE PATH OUT``.

Reduces a fixed sequence of tensors (shapes that fit a slot and shapes that fall back
to gloo, mixed) through :class:`SharedMemoryAllReduce` and saves the results.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from stages.model.shm_allreduce import SharedMemoryAllReduce

SLOT_BYTES = 8 * 64 * 4
SHAPES = [(1, 64), (8, 64), (3, 7), (9, 64), (8, 64), (40, 64), (2, 64)] * 6


def inputs(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(*shape, generator=generator) for shape in SHAPES]


def main() -> None:
    rank, size, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}.rdv", rank=rank, world_size=size)
    try:
        reduce = SharedMemoryAllReduce(
            path, rank=rank, size=size, slot_bytes=SLOT_BYTES, fallback=dist.all_reduce,
            timeout_s=30,
        )  # fmt: skip
        results = {str(i): reduce(x).clone() for i, x in enumerate(inputs(rank))}
    finally:
        dist.destroy_process_group()
    save_file(results, out)


if __name__ == "__main__":
    main()
