"""The scheduler without a connector: batching, chunking, caching, preemption, finishing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

import stages.schedule as schedule_pkg
from pipeline.artifacts import FanInOutput, ScheduledRequest, SchedulerOutput
from pipeline.config import EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError, InvalidRequestError, StageError
from pipeline.request import Request, RequestOutput, RequestStatus
from stages.schedule import Scheduler


class Step(NamedTuple):
    scheduled: SchedulerOutput
    outputs: list[RequestOutput]


def fake_token(item: ScheduledRequest) -> int:
    """A deterministic "model": the token depends on the request and its position."""
    return 1000 + (sum(map(ord, item.req_id)) * 31 + item.num_output_tokens * 7) % 997


def make_scheduler(**overrides: Any) -> Scheduler:
    options: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,
        "max_model_len": 256,
    }
    options.update(overrides)
    return Scheduler(**options)


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


class TestConstruction:
    def test_from_config_takes_sizes_seed_and_policy(self) -> None:
        """from_config derives every scheduler option from EngineConfig."""
        config = EngineConfig(block_size=8, max_num_seqs=3, max_model_len=128, hash_seed=5)
        scheduler = Scheduler.from_config(config, num_blocks=20, connector=None)
        assert scheduler.num_blocks == 20
        assert scheduler.block_size == 8
        request = add(scheduler, "a", list(range(16)))
        assert request.block_hashes == schedule_pkg.hash_request_tokens(
            list(range(16)), 8, hash_seed=5
        )

    @pytest.mark.parametrize("field", ["num_blocks", "block_size", "max_num_seqs"])
    def test_rejects_non_positive_sizes(self, field: str) -> None:
        """A non-positive size is refused with an error naming the field."""
        with pytest.raises(InvalidConfigError, match=field):
            make_scheduler(**{field: 0})

    def test_rejects_unknown_load_failure_policy(self) -> None:
        """Only recompute and fail are accepted."""
        with pytest.raises(InvalidConfigError, match="load_failure_policy"):
            make_scheduler(load_failure_policy="ignore")

    def test_exports_every_public_name_once(self) -> None:
        """The package __all__ lists each public name exactly once, all importable."""
        names = schedule_pkg.__all__
        assert len(names) == len(set(names))
        for name in names:
            assert getattr(schedule_pkg, name) is not None


class TestAddRequest:
    def test_hashes_full_prompt_blocks_and_waits(self) -> None:
        """A new request is WAITING with the hashes of its full prompt blocks."""
        scheduler = make_scheduler()
        request = add(scheduler, "a", list(range(10)))
        assert request.status == RequestStatus.WAITING
        assert len(request.block_hashes) == 2
        assert scheduler.num_unfinished_requests() == 1

    def test_duplicate_id_is_refused(self) -> None:
        """A second request with an unfinished request's id is refused."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2])
        with pytest.raises(InvalidRequestError, match="'a'"):
            add(scheduler, "a", [3, 4])

    def test_id_can_be_reused_after_finish(self) -> None:
        """Once a request finished, its id may be used again."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2], max_tokens=1)
        run_to_completion(scheduler)
        add(scheduler, "a", [1, 2], max_tokens=1)
        assert run_to_completion(scheduler)["a"].finish_reason == "length"

    def test_prompt_that_can_never_fit_is_refused(self) -> None:
        """Empty prompts and prompts longer than max_model_len or the pool are refused."""
        scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
        with pytest.raises(InvalidRequestError, match="at least 1"):
            add(scheduler, "a", [])
        with pytest.raises(InvalidRequestError, match="capacity of 8"):
            add(scheduler, "b", list(range(9)))


class TestBatching:
    def test_step_id_increments_even_when_idle(self) -> None:
        """Every schedule() call gets the next step id, scheduled or not."""
        scheduler = make_scheduler()
        ids = [scheduler.schedule().step_id for _ in range(3)]
        assert ids == [0, 1, 2]
        assert scheduler.schedule().is_empty

    def test_token_budget_is_respected(self) -> None:
        """No step schedules more than max_num_batched_tokens tokens."""
        scheduler = make_scheduler(max_num_batched_tokens=10)
        for i in range(5):
            add(scheduler, f"r{i}", list(range(i * 50, i * 50 + 7)))
        while scheduler.has_unfinished_requests():
            result = step(scheduler)
            assert result.scheduled.total_num_scheduled_tokens <= 10
        assert_idle(scheduler)

    def test_max_num_seqs_is_respected(self) -> None:
        """At most max_num_seqs requests run in one step; the rest wait their turn."""
        scheduler = make_scheduler(max_num_seqs=2)
        for i in range(5):
            add(scheduler, f"r{i}", [i + 1, i + 2], max_tokens=3)
        first = step(scheduler).scheduled
        assert [r.req_id for r in first.requests] == ["r0", "r1"]
        while scheduler.has_unfinished_requests():
            assert len(step(scheduler).scheduled.requests) <= 2
        assert_idle(scheduler)

    def test_chunked_prefill_covers_the_prompt_exactly(self) -> None:
        """A long prompt is split into chunks that sum to it; only the last one samples."""
        scheduler = make_scheduler(max_num_batched_tokens=8)
        prompt = list(range(100, 123))
        add(scheduler, "a", prompt, max_tokens=2)
        chunks: list[ScheduledRequest] = []
        while not chunks or not chunks[-1].sample:
            (item,) = step(scheduler).scheduled.requests
            chunks.append(item)
        assert [len(c.token_ids) for c in chunks] == [8, 8, 7]
        assert [c.num_computed_tokens for c in chunks] == [0, 8, 16]
        assert sum((c.token_ids for c in chunks), ()) == tuple(prompt)
        assert [c.sample for c in chunks] == [False, False, True]

    def test_decode_schedules_one_token_after_prefill(self) -> None:
        """After the prompt, each step computes the previously sampled token."""
        scheduler = make_scheduler()
        add(scheduler, "a", [5, 6, 7], max_tokens=3)
        prefill = step(scheduler)
        (token,) = prefill.outputs[0].new_token_ids
        decode = step(scheduler).scheduled.requests[0]
        assert decode.token_ids == (token,)
        assert decode.num_computed_tokens == 3
        assert decode.num_output_tokens == 1
        assert decode.sample

    def test_block_ids_are_whole_table_first_then_only_appended(self) -> None:
        """new=True carries the whole block table; later steps carry only new blocks."""
        scheduler = make_scheduler(block_size=4)
        add(scheduler, "a", [1, 2, 3, 4, 5, 6], max_tokens=8)
        first = step(scheduler).scheduled.requests[0]
        assert first.new and len(first.block_ids) == 2
        sent = list(first.block_ids)
        for _ in range(6):
            item = step(scheduler).scheduled.requests[0]
            assert not item.new
            sent.extend(item.block_ids)
        assert sent == scheduler.kv_cache_manager.get_block_ids("a")

    def test_running_requests_go_before_new_ones(self) -> None:
        """A decode of a running request is scheduled before a newly added request."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2, 3])
        step(scheduler)
        add(scheduler, "b", [4, 5, 6])
        assert [r.req_id for r in step(scheduler).scheduled.requests] == ["a", "b"]


class TestPrefixCaching:
    def test_second_request_reuses_cached_prefix_blocks(self) -> None:
        """A later request with the same prefix hits its full blocks and reports them."""
        scheduler = make_scheduler(block_size=4)
        add(scheduler, "a", list(range(10)), max_tokens=1)
        run_to_completion(scheduler)
        add(scheduler, "b", [*range(8), 77, 78, 79], max_tokens=1)
        result = step(scheduler)
        item = result.scheduled.requests[0]
        assert item.num_computed_tokens == 8
        assert item.token_ids == (77, 78, 79)
        assert result.outputs[0].num_cached_tokens == 8
        assert_idle(scheduler)

    def test_identical_prompt_recomputes_only_the_last_block(self) -> None:
        """A fully cached prompt still computes its last block for logits."""
        scheduler = make_scheduler(block_size=4)
        add(scheduler, "a", list(range(8)), max_tokens=1)
        run_to_completion(scheduler)
        add(scheduler, "b", list(range(8)), max_tokens=1)
        item = step(scheduler).scheduled.requests[0]
        assert (item.num_computed_tokens, item.token_ids) == (4, (4, 5, 6, 7))

    def test_hits_within_the_same_step(self) -> None:
        """A request admitted after another in the same step hits its newly cached blocks."""
        scheduler = make_scheduler(block_size=4)
        add(scheduler, "a", list(range(9)))
        add(scheduler, "b", list(range(9)))
        a, b = step(scheduler).scheduled.requests
        assert b.num_computed_tokens == 8
        assert b.block_ids[:2] == a.block_ids[:2]

    def test_disabled_prefix_caching_never_hits(self) -> None:
        """With prefix caching off, every request computes its whole prompt."""
        scheduler = make_scheduler(enable_prefix_caching=False)
        add(scheduler, "a", list(range(10)), max_tokens=1)
        run_to_completion(scheduler)
        add(scheduler, "b", list(range(10)), max_tokens=1)
        assert step(scheduler).scheduled.requests[0].num_computed_tokens == 0
        assert scheduler.num_cached_blocks == 0


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
