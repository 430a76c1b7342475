"""The scheduler without a connector: construction, admission, batching, prefix caching."""

from __future__ import annotations

import pytest
from schedule_driver import (
    add,
    assert_idle,
    make_scheduler,
    run_to_completion,
    step,
)

import stages.scheduler as schedule_pkg
from pipeline.artifacts import ScheduledRequest
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError, InvalidRequestError
from pipeline.request import RequestStatus
from stages.scheduler import Scheduler


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
