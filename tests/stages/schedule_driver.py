"""A hand-driven scheduler loop for the scheduler tests: a fake model, steps, checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from connectors.base import KVConnectorScheduler
from pipeline.artifacts import FanInOutput, ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.request import Request, RequestOutput
from stages.scheduler import Scheduler, SchedulerSettings


class Step(NamedTuple):
    scheduled: SchedulerOutput
    outputs: list[RequestOutput]


def fake_token(item: ScheduledRequest) -> int:
    """A deterministic "model": the token depends on the request and its position."""
    return 1000 + (sum(map(ord, item.req_id)) * 31 + item.num_output_tokens * 7) % 997


def make_scheduler(
    *, num_blocks: int = 64, connector: KVConnectorScheduler | None = None, **overrides: Any
) -> Scheduler:
    options: dict[str, Any] = {
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,
        "max_model_len": 256,
    }
    options.update(overrides)
    return Scheduler(SchedulerSettings(**options), num_blocks=num_blocks, connector=connector)


def add(scheduler: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens))
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, model: Callable[[ScheduledRequest], int] = fake_token) -> Step:
    so = scheduler.schedule()
    sampled = {item.req_id: model(item) for item in so.requests if item.sample}
    outs = scheduler.update_from_output(
        so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled)
    )
    return Step(so, outs)


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return final
        for out in step(scheduler).outputs:
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("requests did not finish")


def assert_idle(scheduler: Scheduler) -> None:
    assert scheduler.leak_report() == dict.fromkeys(
        ("blocks_in_use", "requests", "waiting", "running", "pending_transfers"), 0
    )
    assert scheduler.num_free_blocks == scheduler.num_blocks
    assert not scheduler.has_unfinished_requests()
