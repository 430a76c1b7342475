"""The shared-memory all-reduce of CPU tensor-parallel ranks on one host."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.model.shm_allreduce import SharedMemoryAllReduce, available

pytestmark = pytest.mark.skipif(not available(), reason="needs x86-64 store ordering")

HERE = Path(__file__).parent
REPO = HERE.parent.parent.parent


def run_ranks(size: int, tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    path = tmp_path / "allreduce"
    outs = [tmp_path / f"rank{r}.safetensors" for r in range(size)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "shm_rank.py"), str(r), str(size), str(path), str(out)],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        for r, out in enumerate(outs)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * size
    return [load_file(str(out)) for out in outs]


class TestSharedMemoryAllReduce:
    @pytest.mark.parametrize("size", [2, 3])
    def test_sums_match_and_every_rank_gets_the_same_bits(self, size: int, tmp_path: Path) -> None:
        """Each call's result is the sum of every rank's tensor, bit-identical across
        ranks, for tensors that fit a slot and tensors that fall back to gloo alike."""
        sys.path.insert(0, str(HERE))
        import shm_rank

        results = run_ranks(size, tmp_path)
        inputs = [shm_rank.inputs(r) for r in range(size)]
        for i in range(len(shm_rank.SHAPES)):
            expected = sum(inputs[r][i] for r in range(size))
            for r in range(size):
                torch.testing.assert_close(results[r][str(i)], expected, atol=1e-5, rtol=0)
                assert torch.equal(results[r][str(i)], results[0][str(i)])

    def test_a_rank_that_never_arrives_times_out(self, tmp_path: Path) -> None:
        """Rank 0 of 2 alone: the call raises TimeoutError naming rank 1, in bounded time."""
        reduce = SharedMemoryAllReduce(
            tmp_path / "allreduce",
            rank=0,
            size=2,
            slot_bytes=1024,
            fallback=lambda t: None,
            timeout_s=0.3,
        )
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not arrive"):
            reduce(torch.ones(4))
        assert time.monotonic() - start < 5
