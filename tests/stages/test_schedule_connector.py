"""The scheduler's connector hooks: call order, external tokens, async loads, delayed frees,
load failures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from connectors.base import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorScheduler,
    MatchResult,
    RequestFinishedResult,
)
from pipeline.artifacts import FanInOutput, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.request import Request, RequestOutput, RequestStatus
from stages.scheduler import Scheduler, SchedulerSettings


@attrs.frozen
class FakeMeta(KVConnectorMetadata):
    step_id: int
    num_requests: int


class FakeConnector(KVConnectorScheduler):
    """Records every hook call as a tuple; answers from per-request tables."""

    def __init__(self) -> None:
        super().__init__(ConnectorContext(role=KVConnectorRole.SCHEDULER))
        self.calls: list[tuple[Any, ...]] = []
        self.matches: dict[str, MatchResult] = {}
        self.delay_free: set[str] = set()
        self.fail_on_finish = False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return self.matches.get(request.request_id, MatchResult(0))

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.calls.append(("alloc", request.request_id, tuple(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert scheduler_output.kv_connector_metadata is None
        self.calls.append(("meta", scheduler_output.step_id))
        return FakeMeta(scheduler_output.step_id, len(scheduler_output.requests))

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        self.calls.append(("finished", request.request_id, tuple(block_ids)))
        if self.fail_on_finish:
            raise RuntimeError("connector broke")
        delay = request.request_id in self.delay_free
        return RequestFinishedResult(delay_free=delay, kv_transfer_params={"sent": delay})

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.calls.append(("output", output))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


def make(connector: FakeConnector, *, num_blocks: int = 32, **overrides: Any) -> Scheduler:
    options: dict[str, Any] = {
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 128,
    }
    options.update(overrides)
    return Scheduler(SchedulerSettings(**options), num_blocks=num_blocks, connector=connector)


def add(scheduler: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens))
    scheduler.add_request(request)
    return request


def update(scheduler: Scheduler, so: SchedulerOutput, **fields: Any) -> list[RequestOutput]:
    sampled = {item.req_id: 900 + item.num_output_tokens for item in so.requests if item.sample}
    return scheduler.update_from_output(
        so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled, **fields)
    )


def idle(scheduler: Scheduler) -> bool:
    return not any(scheduler.leak_report().values()) and not scheduler.has_unfinished_requests()


class TestHookOrder:
    def test_hooks_run_in_order_with_their_arguments(self) -> None:
        """match → alloc → meta at schedule, output at update, finished at the end."""
        connector = FakeConnector()
        scheduler = make(connector)
        add(scheduler, "a", list(range(6)), max_tokens=1)
        so = scheduler.schedule()
        assert connector.calls[:3] == [
            ("match", "a", 0),
            ("alloc", "a", so.requests[0].block_ids, 0),
            ("meta", 0),
        ]
        assert so.kv_connector_metadata == FakeMeta(0, 1)
        update(scheduler, so)
        assert connector.names() == ["match", "alloc", "meta", "finished", "output"]
        assert connector.calls[3] == ("finished", "a", so.requests[0].block_ids)
        assert idle(scheduler)

    def test_meta_is_built_on_empty_steps_and_output_once_per_update(self) -> None:
        """build_connector_meta runs every step; update_connector_output once per update."""
        connector = FakeConnector()
        scheduler = make(connector)
        for _ in range(3):
            so = scheduler.schedule()
            update(scheduler, so, finished_sending=frozenset({"ghost"}))
        assert connector.names() == ["meta", "output"] * 3
        output = connector.calls[-1][1]
        assert output == KVConnectorOutput(finished_sending=frozenset({"ghost"}))

    def test_abort_tells_the_connector(self) -> None:
        """Aborting a request calls request_finished with its blocks."""
        connector = FakeConnector()
        scheduler = make(connector)
        add(scheduler, "a", list(range(6)))
        so = scheduler.schedule()
        scheduler.abort_requests(["a"])
        assert connector.calls[-1] == ("finished", "a", so.requests[0].block_ids)
        assert idle(scheduler)

    def test_failing_request_finished_still_frees_blocks(self) -> None:
        """A connector raising in request_finished cannot leak the request's blocks."""
        connector = FakeConnector()
        connector.fail_on_finish = True
        scheduler = make(connector)
        add(scheduler, "a", list(range(6)))
        scheduler.schedule()
        assert scheduler.abort_requests(["a"])[0].finish_reason == "abort"
        assert idle(scheduler)


class TestExternalTokens:
    def test_external_tokens_follow_the_local_hit(self) -> None:
        """Matched tokens extend the local prefix hit and are not charged to the budget."""
        connector = FakeConnector()
        scheduler = make(connector)
        add(scheduler, "warm", list(range(5)), max_tokens=1)
        update(scheduler, scheduler.schedule())  # caches block 0
        connector.calls.clear()
        connector.matches["a"] = MatchResult(8)
        add(scheduler, "a", list(range(16)), max_tokens=1)
        so = scheduler.schedule()
        (item,) = so.requests
        assert connector.calls[0] == ("match", "a", 4)
        assert connector.calls[1][3] == 8
        assert (item.num_computed_tokens, len(item.token_ids)) == (12, 4)
        assert so.total_num_scheduled_tokens == 4
        (out,) = update(scheduler, so)
        assert out.num_cached_tokens == 12
        assert scheduler.requests == {}

    def test_synchronous_claim_of_the_whole_prompt_leaves_one_token(self) -> None:
        """A synchronous match covering the whole prompt is clamped to leave the last token."""
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(8)
        scheduler = make(connector)
        add(scheduler, "a", list(range(8)))
        (item,) = scheduler.schedule().requests
        assert (item.num_computed_tokens, item.token_ids) == (7, (7,))
        assert connector.calls[1][3] == 7

    def test_unknown_match_skips_the_request_this_step(self) -> None:
        """num_tokens=None skips the request; those behind it run; it is asked again."""
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(None)
        scheduler = make(connector)
        add(scheduler, "a", [1, 2, 3])
        add(scheduler, "b", [4, 5, 6])
        so = scheduler.schedule()
        assert [r.req_id for r in so.requests] == ["b"]
        update(scheduler, so)
        connector.matches["a"] = MatchResult(0)
        so = scheduler.schedule()
        assert [r.req_id for r in so.requests] == ["b", "a"]
        assert [c[1] for c in connector.calls if c[0] == "match"] == ["a", "b", "a"]


class TestAsyncLoad:
    def test_parked_until_finished_recving_then_resumes_from_loaded_tokens(self) -> None:
        """load_async parks the request; finished_recving makes it run from the loaded KV."""
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(8, load_async=True)
        scheduler = make(connector)
        request = add(scheduler, "a", list(range(10)), max_tokens=1)
        so = scheduler.schedule()
        assert so.is_empty
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        alloc = next(c for c in connector.calls if c[0] == "alloc")
        # 2 blocks receive the 8 loaded tokens; a 3rd is reserved for the next token, so
        # the parked request can run once loaded even if parked loads hold the rest.
        assert alloc[3] == 8 and len(alloc[2]) == 3
        assert scheduler.leak_report()["pending_transfers"] == 1
        assert scheduler.num_cached_blocks == 0  # not cached before the KV arrives
        update(scheduler, so)
        assert scheduler.schedule().is_empty  # still loading
        update(scheduler, scheduler.schedule(), finished_recving=frozenset({"a"}))
        assert request.status == RequestStatus.WAITING
        assert scheduler.num_cached_blocks == 2
        so = scheduler.schedule()
        (item,) = so.requests
        assert item.new and item.num_computed_tokens == 8
        assert item.token_ids == (8, 9)
        assert item.block_ids[: len(alloc[2])] == tuple(alloc[2])
        (out,) = update(scheduler, so)
        assert out.finished and out.num_cached_tokens == 8
        assert idle(scheduler)

    def test_async_load_of_the_whole_prompt_recomputes_the_last_token(self) -> None:
        """An async load covering the whole prompt still leaves the last token to compute."""
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(8, load_async=True)
        scheduler = make(connector)
        add(scheduler, "a", list(range(8)))
        update(scheduler, scheduler.schedule(), finished_recving=frozenset({"a"}))
        (item,) = scheduler.schedule().requests
        assert (item.num_computed_tokens, item.token_ids) == (7, (7,))

    def test_abort_while_loading(self) -> None:
        """A parked request can be aborted; a late finished_recving for it is dropped."""
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(4, load_async=True)
        scheduler = make(connector)
        add(scheduler, "a", list(range(6)))
        scheduler.schedule()
        scheduler.abort_requests(["a"])
        update(scheduler, scheduler.schedule(), finished_recving=frozenset({"a"}))
        assert idle(scheduler)


class TestDelayedFree:
    def test_blocks_stay_until_finished_sending(self) -> None:
        """delay_free keeps the blocks (pending transfer) until finished_sending names it."""
        connector = FakeConnector()
        connector.delay_free.add("a")
        scheduler = make(connector)
        request = add(scheduler, "a", list(range(6)), max_tokens=1)
        (out,) = update(scheduler, scheduler.schedule())
        assert out.finished
        assert request.kv_transfer_params == {"sent": True}
        report = scheduler.leak_report()
        assert report["pending_transfers"] == 1 and report["blocks_in_use"] == 2
        assert scheduler.has_unfinished_requests()
        assert scheduler.num_unfinished_requests() == 0
        update(scheduler, scheduler.schedule())
        assert scheduler.leak_report()["pending_transfers"] == 1
        update(scheduler, scheduler.schedule(), finished_sending=frozenset({"a"}))
        assert idle(scheduler)

    def test_id_in_transfer_cannot_be_reused(self) -> None:
        """A new request may not take the id of a finished request still sending."""
        connector = FakeConnector()
        connector.delay_free.add("a")
        scheduler = make(connector)
        add(scheduler, "a", [1, 2], max_tokens=1)
        update(scheduler, scheduler.schedule())
        with pytest.raises(ValueError, match="unique"):
            add(scheduler, "a", [1, 2])

    def test_failed_save_releases_blocks(self) -> None:
        """A save failure of a delay-freed request releases its blocks."""
        connector = FakeConnector()
        connector.delay_free.add("a")
        scheduler = make(connector)
        add(scheduler, "a", list(range(6)), max_tokens=1)
        update(scheduler, scheduler.schedule())
        update(scheduler, scheduler.schedule(), failed_save_req_ids=frozenset({"a"}))
        assert idle(scheduler)


class TestLoadErrors:
    def _loaded(self, policy: str) -> tuple[Scheduler, SchedulerOutput]:
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(12)
        scheduler = make(connector, load_failure_policy=policy)
        add(scheduler, "a", list(range(16)), max_tokens=2)
        return scheduler, scheduler.schedule()

    def test_recompute_truncates_to_the_last_valid_block(self) -> None:
        """Under recompute, the token is discarded and KV is recomputed from the bad block."""
        scheduler, so = self._loaded("recompute")
        (item,) = so.requests
        assert item.num_computed_tokens == 12
        bad = item.block_ids[1]
        assert scheduler.num_cached_blocks == 4
        assert update(scheduler, so, invalid_block_ids=frozenset({bad})) == []
        assert scheduler.num_cached_blocks == 1
        (again,) = scheduler.schedule().requests
        assert again.num_computed_tokens == 4
        assert again.token_ids == tuple(range(4, 16))

    def test_fail_policy_fails_the_request_alone(self) -> None:
        """Under fail, a request whose blocks failed to load ends with an error."""
        scheduler, so = self._loaded("fail")
        bad = so.requests[0].block_ids[2]
        add(scheduler, "b", [50, 51])
        (out,) = update(scheduler, so, invalid_block_ids=frozenset({bad}))
        assert out.finish_reason == "error" and str(bad) in (out.error or "")
        assert [r.req_id for r in scheduler.schedule().requests] == ["b"]

    def test_async_load_error_shortens_the_loaded_prefix(self) -> None:
        """An async load with a failed block resumes from the last valid block."""
        connector = FakeConnector()
        connector.matches["a"] = MatchResult(12, load_async=True)
        scheduler = make(connector)
        add(scheduler, "a", list(range(16)))
        scheduler.schedule()
        bad = scheduler.kv_cache_manager.get_block_ids("a")[2]
        update(
            scheduler,
            scheduler.schedule(),
            finished_recving=frozenset({"a"}),
            invalid_block_ids=frozenset({bad}),
        )
        assert scheduler.num_cached_blocks == 2  # only the valid prefix is cached
        (item,) = scheduler.schedule().requests
        assert item.num_computed_tokens == 8
