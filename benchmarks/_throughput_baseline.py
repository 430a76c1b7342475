"""The serving comparison's baseline: transformers ``generate()`` as a static-batch server
(each batch of up to ``--batch`` arrived requests is left-padded and decoded to its
longest output before the next batch starts), in a child process of
``throughput.py --serving``."""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["baseline"]


class Job(Protocol):
    """A request of the workload (``_throughput_serving.Job``)."""

    @property
    def arrival_s(self) -> float: ...

    @property
    def prompt(self) -> list[int]: ...

    @property
    def max_tokens(self) -> int: ...


class _StepClock:
    """A transformers streamer that stamps each decoding step (the first ``put`` is the
    prompt, not a step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def baseline(args: argparse.Namespace, path: Path, jobs: Sequence[Job], warm: Sequence[Job]) -> Any:
    """The transformers static-batch server loop over ``jobs`` (after ``warm``): each
    request's token times and ids, and unpadded reference outputs of the first
    ``--check-requests``."""
    import transformers

    dtype = getattr(torch, args.dtypes[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # as kvstep's ignore_eos
    with torch.inference_mode():
        _static_batches(model, warm, args.batch)
        records = _static_batches(model, jobs, args.batch)
        refs = [_generate(model, [j], None)[1][0] for j in jobs[: args.check_requests]]
    return {"requests": records, "reference": refs}


def _static_batches(model: Any, jobs: Sequence[Job], batch: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{} for _ in jobs]
    waiting = deque(range(len(jobs)))
    batches: list[list[int]] = []
    start = time.perf_counter()
    while waiting:
        now = time.perf_counter() - start
        if jobs[waiting[0]].arrival_s > now:
            time.sleep(jobs[waiting[0]].arrival_s - now)
            continue
        taken: list[int] = []
        while waiting and len(taken) < batch and jobs[waiting[0]].arrival_s <= now:
            taken.append(waiting.popleft())
        clock = _StepClock()
        width, tokens = _generate(model, [jobs[i] for i in taken], clock)
        for row, i in enumerate(taken):
            times = [t - start for t in clock.times[: jobs[i].max_tokens]]
            shape = {"index": len(batches), "width": width, "steps": len(clock.times)}
            records[i] = {"times": times, "tokens": tokens[row], "batch": shape}
        batches.append(taken)
    return records


def _generate(model: Any, jobs: Sequence[Job], clock: _StepClock | None) -> tuple[int, list]:
    """One left-padded ``generate`` to the batch's longest output; each row's own tokens."""
    width = max(len(j.prompt) for j in jobs)
    ids = torch.zeros((len(jobs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, job in enumerate(jobs):
        ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt)
        mask[row, width - len(job.prompt) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max(j.max_tokens for j in jobs),
        do_sample=False,
        pad_token_id=0,
        streamer=clock,
    )
    return width, [out[row, width : width + j.max_tokens].tolist() for row, j in enumerate(jobs)]
