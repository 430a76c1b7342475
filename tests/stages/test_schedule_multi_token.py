"""Multi-token steps in the scheduler: a request given several tokens in one step, and
draft tokens in the budget (vLLM's ``num_tokens_with_spec``)."""

from __future__ import annotations

from typing import Any

from schedule_driver import add, assert_idle, make_scheduler

from pipeline.artifacts import FanInOutput, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.logprobs import TokenLogprob
from pipeline.request import Request, RequestOutput
from stages.scheduler import Scheduler


def apply(
    scheduler: Scheduler, so: SchedulerOutput, tokens: dict[str, tuple[int, ...]], **fields: object
) -> list[RequestOutput]:
    return scheduler.update_from_output(
        so, FanInOutput(step_id=so.step_id, sampled_token_ids=tokens, **fields)
    )


def prefill(scheduler: Scheduler, req_id: str, prompt: list[int], **params: Any) -> Request:
    """Add a request and run its prefill step (one token sampled: 100)."""
    request = Request(req_id, prompt, SamplingParams(**params))
    scheduler.add_request(request)
    so = scheduler.schedule()
    apply(scheduler, so, {req_id: (100,)}, logprobs={req_id: (TokenLogprob(100, -0.5, 1),)})
    return request


class TestSeveralTokens:
    def test_every_token_is_appended(self) -> None:
        """All tokens of the sequence join the request, in order, in one output; the
        next step computes the KV of every one not computed yet and samples after it."""
        scheduler = make_scheduler()
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        so = scheduler.schedule()
        (out,) = apply(scheduler, so, {"a": (101, 102, 103)})
        assert out.new_token_ids == (101, 102, 103) and not out.finished
        assert out.token_ids == (100, 101, 102, 103)
        assert request.num_computed_tokens == 4  # prompt + 100; 101..103 not yet
        (item,) = scheduler.schedule().requests
        assert (item.num_computed_tokens, item.token_ids, item.sample) == (4, (101, 102, 103), True)
        assert item.num_output_tokens == 4

    def test_stops_at_the_first_stop_token(self) -> None:
        """Tokens after the first stop token are dropped; the request ends with "stop",
        that token as its stop_reason, and its blocks free."""
        scheduler = make_scheduler()
        prefill(scheduler, "a", [1, 2, 3], max_tokens=10, stop_token_ids=[7])
        (out,) = apply(scheduler, scheduler.schedule(), {"a": (101, 7, 102, 7)})
        assert out.new_token_ids == (101, 7) and out.token_ids == (100, 101, 7)
        assert (out.finished, out.finish_reason, out.stop_reason) == (True, "stop", 7)
        assert "a" in scheduler.schedule().finished_req_ids
        assert_idle(scheduler)

    def test_stops_at_eos(self) -> None:
        """EOS in the middle of the sequence ends the request there."""
        scheduler = make_scheduler()
        scheduler.add_request(Request("a", [1, 2], SamplingParams(max_tokens=10), eos_token_id=2))
        (out,) = apply(scheduler, scheduler.schedule(), {"a": (5, 2, 6)})
        assert out.token_ids == (5, 2) and out.finish_reason == "stop"
        assert_idle(scheduler)

    def test_stops_at_max_tokens(self) -> None:
        """A sequence longer than what max_tokens leaves is cut at max_tokens."""
        scheduler = make_scheduler()
        prefill(scheduler, "a", [1, 2, 3], max_tokens=3)
        (out,) = apply(scheduler, scheduler.schedule(), {"a": (101, 102, 103, 104)})
        assert out.new_token_ids == (101, 102) and out.token_ids == (100, 101, 102)
        assert out.finish_reason == "length"
        assert_idle(scheduler)

    def test_stops_at_max_model_len(self) -> None:
        """The longest length also cuts the sequence."""
        scheduler = make_scheduler(max_model_len=6)
        prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        (out,) = apply(scheduler, scheduler.schedule(), {"a": (101, 102, 103)})
        assert out.token_ids == (100, 101, 102) and out.finish_reason == "length"
        assert_idle(scheduler)

    def test_blocks_and_hashes_follow_the_tokens(self) -> None:
        """The blocks a step's tokens fill are hashed once known, and a request cut by
        a stop releases every block (no block for a dropped token stays held)."""
        scheduler = make_scheduler()  # block_size 4
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=20)
        assert len(request.block_hashes) == 1  # [1, 2, 3, 100]
        apply(scheduler, scheduler.schedule(), {"a": (101, 102, 103, 104, 105)})
        assert request.num_tokens == 9 and len(request.block_hashes) == 2
        (item,) = scheduler.schedule().requests  # 101..105 computed now: a third block
        assert item.token_ids == (101, 102, 103, 104, 105)
        assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3
        scheduler.abort_requests(["a"])
        assert_idle(scheduler)

    def test_logprobs_one_per_token_kept(self) -> None:
        """The request's logprobs grow by one entry per token appended; those of the
        dropped tokens are not kept."""
        scheduler = make_scheduler()
        prefill(scheduler, "a", [1, 2, 3], max_tokens=10, logprobs=0, stop_token_ids=[7])
        so = scheduler.schedule()
        entries = tuple(TokenLogprob(t, -float(i), 1) for i, t in enumerate((101, 7, 102)))
        (out,) = apply(scheduler, so, {"a": (101, 7, 102)}, logprobs={"a": entries})
        assert out.logprobs is not None
        assert [e.token_id for e in out.logprobs] == [100, 101, 7]

    def test_logprobs_must_cover_every_token(self) -> None:
        """One logprob for a three-token sequence fails the request alone."""
        scheduler = make_scheduler()
        prefill(scheduler, "a", [1, 2, 3], max_tokens=10, logprobs=0)
        so = scheduler.schedule()
        (out,) = apply(
            scheduler, so, {"a": (101, 102, 103)}, logprobs={"a": (TokenLogprob(101, -1.0, 1),)}
        )
        assert out.finish_reason == "error" and "logprob" in (out.error or "")
        assert_idle(scheduler)


class TestDrafts:
    def test_budget_counts_drafts(self) -> None:
        """A running request's drafts are scheduled after its last token and take their
        share of the budget: the next request's prefill chunk gets what is left."""
        scheduler = make_scheduler(max_num_batched_tokens=8)
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        request.draft_token_ids = [201, 202, 203]
        add(scheduler, "b", list(range(10, 20)))
        assert request.num_tokens_with_spec == request.num_tokens + 3
        so = scheduler.schedule()
        a, b = so.requests
        assert (a.token_ids, a.draft_token_ids, a.sample) == ((100,), (201, 202, 203), True)
        assert a.num_scheduled_tokens == 4 and len(b.token_ids) == 4  # 8 - (1 + 3)
        assert so.total_num_scheduled_tokens == 8
        assert request.num_computed_tokens == 7 and request.draft_token_ids == []

    def test_drafts_cut_by_the_budget(self) -> None:
        """Only the drafts that fit are scheduled; the others are dropped."""
        scheduler = make_scheduler(max_num_batched_tokens=3)
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        request.draft_token_ids = [201, 202, 203]
        (item,) = scheduler.schedule().requests
        assert item.draft_token_ids == (201, 202) and request.draft_token_ids == []

    def test_drafts_get_kv_slots_but_no_hash(self) -> None:
        """Drafts crossing a block boundary get the block, which is not cached: the KV
        of a draft is never registered before the draft is accepted."""
        scheduler = make_scheduler()  # block_size 4
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)  # 4 tokens, 1 block
        request.draft_token_ids = [201, 202]
        (item,) = scheduler.schedule().requests
        assert len(item.block_ids) == 1  # positions 4 and 5 need the second block
        assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 2
        assert scheduler.num_cached_blocks == 1  # the first block: its 4 tokens are known
        assert len(request.block_hashes) == 1

    def test_rejected_drafts_are_computed_again(self) -> None:
        """A draft rejected at its position, and those after it, leave the request's
        computed tokens; the accepted ones stay computed."""
        scheduler = make_scheduler()
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        request.draft_token_ids = [201, 202, 203]
        so = scheduler.schedule()
        assert request.num_computed_tokens == 7  # the prompt, 100 and the three drafts
        (out,) = apply(scheduler, so, {"a": (201, 555)})  # 201 accepted, 202 was wrong
        assert out.new_token_ids == (201, 555)
        assert request.num_computed_tokens == 5  # the prompt, 100 and 201
        (item,) = scheduler.schedule().requests
        assert (item.num_computed_tokens, item.token_ids, item.sample) == (5, (555,), True)

    def test_all_drafts_accepted(self) -> None:
        """Every draft accepted plus the token after them: only that last one is left."""
        scheduler = make_scheduler()
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        request.draft_token_ids = [201, 202]
        apply(scheduler, scheduler.schedule(), {"a": (201, 202, 300)})
        assert (request.num_computed_tokens, request.num_tokens) == (6, 7)
        (item,) = scheduler.schedule().requests
        assert item.token_ids == (300,)

    def test_no_drafts_after_a_token_in_flight(self) -> None:
        """A step planned ahead (async scheduling) sends no drafts for a request whose
        token is still being sampled: a draft follows the last known token."""
        scheduler = make_scheduler()
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        scheduler.schedule()  # its token is in flight
        request.draft_token_ids = [201, 202]
        (item,) = scheduler.schedule(ahead=True).requests
        assert item.draft_token_ids == () and item.num_scheduled_tokens == 1
        assert request.num_computed_tokens == 5

    def test_preemption_drops_drafts(self) -> None:
        """A preempted request resumes without the drafts it had."""
        scheduler = make_scheduler(num_blocks=3)  # 12 tokens in all
        prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        b = add(scheduler, "b", [4, 5, 6], max_tokens=10)
        apply(scheduler, scheduler.schedule(), {"a": (101,), "b": (400,)})  # a block each
        b.draft_token_ids = [401, 402, 403, 404, 405]
        scheduler.schedule()  # a takes the last block; b's drafts need two: b is preempted
        assert b.num_computed_tokens == 0 and b.num_preemptions == 1
        assert b.draft_token_ids == []


class TestAheadAfterSeveralTokens:
    def test_step_ahead_does_not_sample_a_known_token(self) -> None:
        """When step N gives a request several tokens, step N+1 (planned while N ran,
        to sample the token after N's first) computes its chunk without sampling: that
        token is known; the step after computes the rest and samples."""
        scheduler = make_scheduler()
        request = prefill(scheduler, "a", [1, 2, 3], max_tokens=10)
        first = scheduler.schedule()
        ahead = scheduler.schedule(ahead=True)
        apply(scheduler, first, {"a": (101, 102, 103)})
        resolved = scheduler.resolve_ahead(ahead, previous_failed=False)
        (item,) = resolved.requests
        assert (item.token_ids, item.sample) == ((101,), False)
        assert request.num_output_placeholders == 0
        assert apply(scheduler, resolved, {}) == []
        (after,) = scheduler.schedule().requests
        assert (after.num_computed_tokens, after.token_ids, after.sample) == (5, (102, 103), True)
