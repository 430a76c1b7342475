"""The ranks of test_tensor_parallel.py, each run as a script in its own process.

``python tests/stages/model/tp_rank_worker.py --rank R --world-size N --init-method URL
--out DIR NAME:SIZE=CHECKPOINT ...`` joins an N-rank gloo group. For each item the ranks
are cut into consecutive tensor-parallel groups of SIZE (SIZE = N uses the whole group
from ``init_process_group``, a smaller SIZE a ``torch.distributed.new_group``); each rank
loads its shard, runs :func:`run_scenario` and writes its logits to
``DIR/NAME.tp{SIZE}.group{G}.rank{r}.safetensors``. The test imports
:func:`run_scenario` too, to compute the unsharded reference with the very same steps.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 16
MAX_MODEL_LEN = 128
_GREEDY = SamplingParams(temperature=0.0)


def _req(
    req_id: str, tokens: list[int], computed: int, blocks: tuple[int, ...], new: bool
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=tuple(tokens),
        num_computed_tokens=computed,
        block_ids=blocks,
        new=new,
        sampling=_GREEDY,
        sample=True,
        num_output_tokens=0,
    )


def scenario() -> list[SchedulerOutput]:
    """A 40-token prefill over 3 blocks; then a decode mixed with a second prefill; a decode."""
    rng = random.Random(0)
    a = [rng.randrange(256) for _ in range(40)]
    b = [rng.randrange(256) for _ in range(9)]
    return [
        SchedulerOutput(step_id=0, requests=(_req("a", a, 0, (5, 2, 11), True),)),
        SchedulerOutput(
            step_id=1,
            requests=(_req("a", [17], 40, (), False), _req("b", b, 0, (7,), True)),
        ),
        SchedulerOutput(
            step_id=2,
            requests=(_req("a", [99], 41, (), False), _req("b", [3], 9, (), False)),
        ),
    ]


def run_scenario(runner: Any) -> dict[str, torch.Tensor]:
    """Logits of every sampled row of :func:`scenario`, keyed ``"{step}.{req_id}"``."""
    logits: dict[str, torch.Tensor] = {}
    for step in scenario():
        out = runner.execute(step)
        for row, req_id in enumerate(out.req_ids):
            logits[f"{step.step_id}.{req_id}"] = out.logits[row].clone()
    return logits


def _group(tp: Any, size: int) -> tuple[Any, int]:
    """This rank's ``TensorParallel`` of ``size`` ranks, and the index of its group."""
    import functools

    import torch.distributed as dist

    from stages.model import TensorParallel

    if size == tp.size:
        return tp, 0
    groups = [dist.new_group(list(range(g, g + size))) for g in range(0, tp.size, size)]
    index = tp.rank // size
    group = groups[index]
    return (
        TensorParallel(
            tp.rank % size,
            size,
            all_reduce=functools.partial(dist.all_reduce, group=group),
            all_gather=functools.partial(dist.all_gather, group=group),
        ),
        index,
    )


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import save_file

    from stages.model import ModelRunner, destroy_process_group, init_process_group

    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("checkpoints", nargs="+", help="NAME:SIZE=PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world = init_process_group(
        backend="gloo",
        init_method=args.init_method,
        rank=args.rank,
        world_size=args.world_size,
        timeout_s=60,
    )
    try:
        for item in args.checkpoints:
            case, _, path = item.partition("=")
            name, _, size = case.partition(":")
            tp, index = _group(world, int(size))
            runner = ModelRunner.load(
                path,
                device="cpu",
                dtype="float32",
                block_size=BLOCK_SIZE,
                num_blocks=NUM_BLOCKS,
                max_model_len=MAX_MODEL_LEN,
                rank=tp.rank,
                world_size=tp.size,
                tp=tp,
            )
            logits = run_scenario(runner)
            runner.close()
            out = args.out / f"{name}.tp{tp.size}.group{index}.rank{tp.rank}.safetensors"
            save_file(logits, str(out))
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main()
