"""The scheduler without a connector: preemption, stop conditions, aborts and failed steps."""

from __future__ import annotations

from typing import Any

import pytest
from schedule_driver import (
    add,
    assert_idle,
    fake_token,
    make_scheduler,
    run_to_completion,
    step,
)

from pipeline.artifacts import FanInOutput, ScheduledRequest
from pipeline.config import SamplingParams
from pipeline.errors import StageError
from pipeline.request import Request, RequestOutput, RequestStatus


class TestPreemption:
    def test_last_request_is_preempted_and_resumes_to_completion(self) -> None:
        """When blocks run out the last running request is preempted, then resumes new."""
        scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
        add(scheduler, "a", [1, 2, 3], max_tokens=10)
        add(scheduler, "b", [4, 5, 6], max_tokens=10)
        preempted = False
        resumed: ScheduledRequest | None = None
        final: dict[str, RequestOutput] = {}
        for _ in range(60):
            if not scheduler.has_unfinished_requests():
                break
            so = scheduler.schedule()
            if not preempted and "b" in so.finished_req_ids:
                preempted = True
                assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
                assert scheduler.requests["b"].num_computed_tokens == 0
                assert [r.req_id for r in so.requests] == ["a"]
            item = next((r for r in so.requests if r.req_id == "b"), None)
            if preempted and resumed is None and item is not None:
                resumed = item
                assert item.block_ids == tuple(scheduler.kv_cache_manager.get_block_ids("b"))
            sampled = {r.req_id: fake_token(r) for r in so.requests if r.sample}
            outs = scheduler.update_from_output(
                so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled)
            )
            final.update({o.request_id: o for o in outs if o.finished})
        assert preempted and resumed is not None
        assert resumed.new and resumed.num_computed_tokens == 0
        assert resumed.token_ids[:3] == (4, 5, 6) and len(resumed.token_ids) > 3
        # Same tokens as an unconstrained run: preemption is invisible in the output.
        reference = make_scheduler()
        add(reference, "a", [1, 2, 3], max_tokens=10)
        add(reference, "b", [4, 5, 6], max_tokens=10)
        expected = run_to_completion(reference)
        assert {k: v.token_ids for k, v in final.items()} == {
            k: v.token_ids for k, v in expected.items()
        }
        assert_idle(scheduler)

    def test_lone_request_that_outgrows_the_pool_stops_with_length(self) -> None:
        """A request that would need more blocks than the pool holds finishes with length."""
        scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=1000)
        add(scheduler, "a", [1, 2, 3], max_tokens=50)
        result = run_to_completion(scheduler)
        assert result["a"].finish_reason == "length"
        assert len(result["a"].token_ids) == 8 - 3
        assert_idle(scheduler)


class TestFinishing:
    @pytest.mark.parametrize(
        ("params", "eos", "reason", "length"),
        [
            ({"stop_token_ids": (1023,)}, None, "stop", 2),
            ({}, 1023, "stop", 2),
            ({"ignore_eos": True}, 1023, "length", 5),
            ({}, None, "length", 5),
        ],
    )
    def test_stop_conditions(
        self, params: dict[str, Any], eos: int | None, reason: str, length: int
    ) -> None:
        """Stop tokens and EOS stop (unless ignore_eos); max_tokens ends with length."""
        scheduler = make_scheduler()
        request = Request("a", [1, 2], SamplingParams(max_tokens=5, **params), eos_token_id=eos)
        scheduler.add_request(request)
        result = run_to_completion(scheduler, max_steps=20)
        out = result["a"]
        assert (out.finish_reason, len(out.token_ids)) == (reason, length)
        assert_idle(scheduler)

    def test_max_model_len_ends_with_length(self) -> None:
        """A request reaching max_model_len tokens stops with length."""
        scheduler = make_scheduler(max_model_len=6)
        add(scheduler, "a", [1, 2, 3, 4], max_tokens=50)
        out = run_to_completion(scheduler)["a"]
        assert out.finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.token_ids) == 6

    def test_outputs_carry_new_and_all_tokens(self) -> None:
        """Each output has the token of this step and every token so far."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2], max_tokens=3)
        seen: list[int] = []
        while scheduler.has_unfinished_requests():
            for out in step(scheduler).outputs:
                seen.extend(out.new_token_ids)
                assert out.token_ids == tuple(seen)
                assert out.prompt_token_ids == (1, 2)
        assert len(seen) == 3

    def test_finished_ids_reach_the_next_step(self) -> None:
        """A finished request's id is in the next SchedulerOutput.finished_req_ids only."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2], max_tokens=1)
        assert step(scheduler).outputs[0].finished
        assert scheduler.schedule().finished_req_ids == {"a"}
        assert scheduler.schedule().finished_req_ids == frozenset()


class TestAbortAndFail:
    def test_abort_frees_blocks_now_and_drops_in_flight_tokens(self) -> None:
        """Abort frees blocks at once; the in-flight step's token for it is dropped."""
        scheduler = make_scheduler()
        add(scheduler, "a", list(range(10)))
        add(scheduler, "b", list(range(20, 30)))
        so = scheduler.schedule()
        outs = scheduler.abort_requests(["a", "nope"])
        assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("a", "abort", True)]
        assert "a" not in scheduler.kv_cache_manager.owners()
        sampled = {r.req_id: fake_token(r) for r in so.requests}
        later = scheduler.update_from_output(
            so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled)
        )
        assert [o.request_id for o in later] == ["b"]
        assert "a" in scheduler.schedule().finished_req_ids
        scheduler.abort_requests(["b"])
        assert_idle(scheduler)

    def test_abort_of_a_waiting_request(self) -> None:
        """A waiting request can be aborted before it ever runs."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2, 3])
        assert scheduler.abort_requests(["a"])[0].finish_reason == "abort"
        assert scheduler.schedule().is_empty
        assert_idle(scheduler)

    def test_fail_requests_uncaches_blocks_of_the_failed_step(self) -> None:
        """A failed step's cache entries are dropped, so a later request recomputes."""
        scheduler = make_scheduler(block_size=4)
        add(scheduler, "a", list(range(12)))
        so = scheduler.schedule()
        assert scheduler.num_cached_blocks == 3
        outs = scheduler.fail_requests([r.req_id for r in so.requests], "worker died")
        assert [(o.finish_reason, o.error) for o in outs] == [("error", "worker died")]
        assert scheduler.num_cached_blocks == 0
        add(scheduler, "b", list(range(12)))
        assert step(scheduler).scheduled.requests[0].num_computed_tokens == 0
        run_to_completion(scheduler)
        assert_idle(scheduler)

    def test_fail_keeps_entries_cached_by_earlier_steps(self) -> None:
        """Blocks cached in earlier, successful steps stay cached when a later step fails."""
        scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8)
        add(scheduler, "a", list(range(13)))
        step(scheduler)  # tokens 0..7: two blocks cached, KV written
        scheduler.schedule()  # tokens 8..12: block 2 cached, then the step fails
        assert scheduler.num_cached_blocks == 3
        scheduler.fail_requests(["a"], "boom")
        assert scheduler.num_cached_blocks == 2
        assert_idle(scheduler)

    def test_fail_after_abort_still_uncaches(self) -> None:
        """A request aborted while its step ran, then failed, leaves no cache entries."""
        scheduler = make_scheduler(block_size=4)
        add(scheduler, "a", list(range(12)))
        scheduler.schedule()
        scheduler.abort_requests(["a"])
        assert scheduler.fail_requests(["a"], "boom") == []
        assert scheduler.num_cached_blocks == 0

    def test_missing_sampled_token_fails_the_request_alone(self) -> None:
        """A request that should have sampled but got no token fails; others go on."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2])
        add(scheduler, "b", [3, 4])
        so = scheduler.schedule()
        outs = scheduler.update_from_output(
            so, FanInOutput(step_id=so.step_id, sampled_token_ids={"b": 1001})
        )
        by_id = {o.request_id: o for o in outs}
        assert by_id["a"].finish_reason == "error" and "no token" in (by_id["a"].error or "")
        assert by_id["b"].new_token_ids == (1001,) and not by_id["b"].finished

    def test_output_of_another_step_is_refused(self) -> None:
        """update_from_output refuses a fan-in output of a different step."""
        scheduler = make_scheduler()
        so = scheduler.schedule()
        with pytest.raises(StageError, match="step 7"):
            scheduler.update_from_output(so, FanInOutput(step_id=7))
