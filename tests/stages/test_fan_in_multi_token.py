"""Fan-in of multi-token steps: the driver rank's token sequences (and one logprob per
token) are merged whole, order-free, and the update applies every token."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from fake_executor import FakeRanks
from schedule_driver import make_scheduler

from pipeline.artifacts import RankOutputs, SchedulerOutput, WorkerOutput
from pipeline.config import SamplingParams
from pipeline.kernel.context import StepContext
from pipeline.logprobs import TokenLogprob
from pipeline.request import Request
from stages.aggregator import FanInAggregator
from stages.execute import ExecuteStage
from stages.fan_in import FanInStage

LPS = tuple(TokenLogprob(t, -1.0 - i, 1) for i, t in enumerate((11, 12, 13)))


def out(rank: int, step: int = 0, **fields: Any) -> WorkerOutput:
    return WorkerOutput(rank=rank, step_id=step, **fields)


def ranks(step: int) -> list[WorkerOutput]:
    """Three ranks' outputs of one step: the driver samples; rank 1 reports tokens of
    its own (ignored), rank 2 a failed load."""
    return [
        out(0, step, sampled_token_ids={"a": (11, 12, 13), "b": 4}, logprobs={"a": LPS}),
        out(1, step, sampled_token_ids={"a": (99,)}),
        out(2, step, invalid_block_ids=frozenset({7})),
    ]


class TestMerge:
    def test_driver_sequences_are_kept_whole(self) -> None:
        """The merge holds the driver's sequence per request (a bare int as one token)
        and one logprob per token, whatever the order of the ranks."""
        merged = FanInAggregator(3).merge(5, ranks(5), now=0)
        assert merged.sampled_token_ids == {"a": (11, 12, 13), "b": (4,)}
        assert merged.logprobs == {"a": LPS}
        assert merged.invalid_block_ids == {7} and merged.num_ranks == 3
        for order in itertools.permutations(ranks(5)):
            assert FanInAggregator(3).merge(5, list(order), now=0) == merged

    def test_update_applies_the_merged_sequences(self) -> None:
        """The scheduler appends every token of each merged sequence."""
        scheduler = make_scheduler()
        for req_id in ("a", "b"):
            scheduler.add_request(Request(req_id, [1, 2, 3], SamplingParams(max_tokens=8)))
        so = scheduler.schedule()
        rank_outputs = [
            out(0, so.step_id, sampled_token_ids={"a": (11, 12, 13), "b": 4}),
            out(1, so.step_id),
        ]
        merged = FanInAggregator(2).merge(so.step_id, rank_outputs, now=0)
        outs = {o.request_id: o for o in scheduler.update_from_output(so, merged)}
        assert outs["a"].new_token_ids == (11, 12, 13) and outs["b"].new_token_ids == (4,)


@pytest.mark.anyio
class TestStage:
    async def test_execute_then_fan_in(self) -> None:
        """Through execute and fan_in, a rank's multi-token output reaches the merge."""

        def answer(output: WorkerOutput) -> Any:
            async def waiter() -> WorkerOutput:
                return output

            return waiter

        outputs = [out(0, 2, sampled_token_ids={"x": (1, 2), "y": 3}), out(1, 2)]
        ctx = StepContext(2, None, inputs=(SchedulerOutput(step_id=2),))
        ctx.put(await ExecuteStage(FakeRanks([answer(o) for o in outputs]), timeout_s=60).run(ctx))
        merged = await FanInStage(FanInAggregator(2)).run(ctx)
        assert ctx.get(RankOutputs).outputs[0].sampled_token_ids == {"x": (1, 2), "y": (3,)}
        assert merged.sampled_token_ids == {"x": (1, 2), "y": (3,)} and merged.num_ranks == 2
