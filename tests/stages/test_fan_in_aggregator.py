"""Fan-in: the aggregator's rank sets and leases, the stage's deadline and failing ranks,
and what the scheduler does with expired transfers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import structlog
from fake_executor import FakeRanks, hang
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from schedule_driver import make_scheduler

from connectors.base import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorScheduler,
    MatchResult,
    RequestFinishedResult,
)
from pipeline.artifacts import (
    FanInOutput,
    KVStats,
    SchedulerOutput,
    WorkerOutput,
)
from pipeline.config import EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError, StageError, WorkerFailedError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.kernel.report import StepReport
from pipeline.request import Request, RequestStatus
from stages.aggregator import FanInAggregator
from stages.execute import ExecuteStage
from stages.fail_step import FailStepStage, describe_failure
from stages.fan_in import FanInStage

W = 3


def out(rank: int, step: int = 0, **fields: Any) -> WorkerOutput:
    return WorkerOutput(rank=rank, step_id=step, **fields)


def sending(rank: int, *req_ids: str, step: int = 0) -> WorkerOutput:
    return out(rank, step, finished_sending=frozenset(req_ids))


def recving(rank: int, *req_ids: str, step: int = 0) -> WorkerOutput:
    return out(rank, step, finished_recving=frozenset(req_ids))


class TestFanInAggregator:
    def test_released_only_once_every_rank_reported(self) -> None:
        """A send reported by ranks in different steps is released at the last rank's."""
        agg = FanInAggregator(W)
        assert agg.merge(0, [sending(0, "a"), out(1), out(2)], now=0).finished_sending == set()
        assert agg.pending_ranks("sending", "a") == {0}
        assert agg.merge(1, [out(0), out(1), sending(2, "a")], now=0).finished_sending == set()
        merged = agg.merge(2, [out(0), sending(1, "a"), out(2)], now=0)
        assert merged.finished_sending == {"a"}
        assert agg.num_pending == 0 and agg.pending_ranks("sending", "a") is None

    def test_a_rank_reporting_twice_counts_once(self) -> None:
        """Duplicates from one rank never stand in for a silent rank (vLLM counts them)."""
        agg = FanInAggregator(W, lease_steps=10)
        for step in range(3):
            merged = agg.merge(step, [recving(0, "a"), recving(1, "a")], now=0)
            assert merged.finished_recving == set()
        assert agg.pending_ranks("recving", "a") == {0, 1}
        assert agg.merge(3, [recving(2, "a")], now=0).finished_recving == {"a"}

    def test_sending_and_recving_are_tracked_apart(self) -> None:
        """All ranks reporting a request's load does not complete its send."""
        agg = FanInAggregator(2)
        merged = agg.merge(0, [recving(0, "a"), recving(1, "a"), sending(0, "a")], now=0)
        assert (merged.finished_recving, merged.finished_sending) == ({"a"}, set())
        assert agg.pending_ranks("sending", "a") == {0}

    def test_single_rank_releases_at_once(self) -> None:
        """With one rank every report is complete in the step it arrives."""
        agg = FanInAggregator(1)
        merged = agg.merge(0, [out(0, finished_sending=frozenset({"a", "b"}))], now=0)
        assert merged.finished_sending == {"a", "b"} and agg.num_pending == 0

    def test_merge_is_order_free(self) -> None:
        """Every order of the same outputs gives the same merged result."""
        outputs = [
            out(
                0,
                sampled_token_ids={"x": 7},
                invalid_block_ids=frozenset({1}),
                stats=KVStats(loaded_tokens=4, saved_bytes=10),
            ),
            out(1, invalid_block_ids=frozenset({2, 3}), failed_save_req_ids=frozenset({"s"})),
            out(2, invalid_block_ids=frozenset({3}), stats=KVStats(loaded_tokens=1, saved_bytes=5)),
        ]
        merged = FanInAggregator(W).merge(4, outputs, now=0)
        for order in itertools.permutations(outputs):
            assert FanInAggregator(W).merge(4, list(order), now=0) == merged
        assert merged.sampled_token_ids == {"x": (7,)}
        assert merged.invalid_block_ids == {1, 2, 3}
        assert merged.failed_save_req_ids == {"s"}
        # Bytes add up; tokens count once (every rank moves the same positions).
        assert merged.stats == KVStats(loaded_tokens=4, saved_bytes=15)
        assert merged.num_ranks == 3

    def test_tokens_come_from_the_driver_rank_only(self) -> None:
        """A non-driver rank's sampled tokens are ignored."""
        merged = FanInAggregator(2).merge(
            0, [out(1, sampled_token_ids={"x": 9}), out(0, sampled_token_ids={"x": 1})], now=0
        )
        assert merged.sampled_token_ids == {"x": (1,)}

    def test_forget_clears_the_entry(self) -> None:
        """After an abort the ranks reported earlier no longer count."""
        agg = FanInAggregator(2, lease_steps=10)
        agg.merge(0, [sending(0, "a"), recving(0, "b")], now=0)
        agg.forget(["a", "b", "unknown"], now=0)
        assert agg.num_pending == 0
        merged = agg.merge(1, [sending(1, "a")], now=0)
        assert merged.finished_sending == set() and agg.pending_ranks("sending", "a") == {1}

    def test_late_loads_of_a_forgotten_request_are_dropped_for_one_lease(self) -> None:
        """Recving reports after forget are dropped until the lease has passed."""
        agg = FanInAggregator(2, lease_steps=3)
        agg.merge(0, [recving(0, "a")], now=0)
        agg.forget(["a"], now=0)
        merged = agg.merge(1, [recving(1, "a")], now=0)
        assert merged.finished_recving == set() and agg.num_pending == 0
        agg.merge(3, [], now=0)  # the forgotten mark's lease is over
        agg.merge(4, [recving(0, "a")], now=0)
        assert agg.pending_ranks("recving", "a") == {0}

    def test_lease_in_steps_expires_with_missing_ranks(self) -> None:
        """An entry still incomplete lease_steps after its first report expires."""
        agg = FanInAggregator(W, lease_steps=2, lease_s=None)
        agg.merge(5, [sending(1, "a")], now=0)
        assert agg.merge(6, [sending(1, "a")], now=1e9).expired_sending == set()
        with structlog.testing.capture_logs() as logs:
            merged = agg.merge(7, [out(0)], now=0)
        assert merged.expired_sending == {"a"} and merged.finished_sending == set()
        assert merged.missing_ranks == {"a": (0, 2)}
        assert agg.num_pending == 0
        (warning,) = [e for e in logs if e["log_level"] == "warning"]
        assert warning["req_id"] == "a" and warning["missing_ranks"] == [0, 2]
        assert warning["transfer"] == "sending"

    def test_lease_in_seconds_expires_recving(self) -> None:
        """An entry still incomplete lease_s seconds after its first report expires."""
        agg = FanInAggregator(2, lease_s=5.0)
        agg.merge(0, [recving(0, "a")], now=100.0)
        assert agg.merge(1, [], now=104.9).expired_recving == set()
        merged = agg.merge(2, [], now=105.0)
        assert merged.expired_recving == {"a"} and merged.missing_ranks == {"a": (1,)}

    def test_a_report_in_the_expiry_step_completes_instead(self) -> None:
        """The last rank reporting in the step the lease ends releases it as finished."""
        agg = FanInAggregator(2, lease_steps=1, lease_s=None)
        agg.merge(0, [sending(0, "a")], now=0)
        merged = agg.merge(1, [sending(1, "a")], now=0)
        assert (merged.finished_sending, merged.expired_sending) == ({"a"}, set())

    def test_recorded_reports_of_a_failed_step_are_released_next_merge(self) -> None:
        """record() keeps the answering ranks' reports; the next merge releases them."""
        agg = FanInAggregator(2)
        agg.merge(0, [sending(0, "a")], now=0)
        agg.record(1, [sending(1, "a")], now=0)
        assert agg.num_pending == 1
        assert agg.merge(2, [], now=0).finished_sending == {"a"}
        assert agg.num_pending == 0

    def test_forget_drops_an_entry_completed_in_a_failed_step(self) -> None:
        """A transfer completed by record() and then forgotten is never released."""
        agg = FanInAggregator(2)
        agg.record(0, [sending(0, "a"), sending(1, "a")], now=0)
        agg.forget(["a"], now=0)
        merged = agg.merge(1, [], now=0)
        assert merged.finished_sending == set() and agg.num_pending == 0

    def test_rank_outside_the_world_is_an_error(self) -> None:
        """An output from rank >= world_size raises StageError naming it."""
        with pytest.raises(StageError, match=r"rank 3.*\[0, 3\)"):
            FanInAggregator(W).merge(0, [out(3)], now=0)

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"world_size": 0}, "world_size"),
            ({"world_size": 2, "lease_steps": 0}, "lease_steps"),
            ({"world_size": 2, "lease_s": 0.0}, "lease_s"),
            ({"world_size": 2, "lease_s": -1}, "lease_s"),
            ({"world_size": 2, "lease_s": None}, "lease"),
        ],
    )
    def test_bad_settings_are_refused(self, kwargs: dict[str, Any], field: str) -> None:
        """Each bad setting raises InvalidConfigError naming the field."""
        with pytest.raises(InvalidConfigError) as info:
            FanInAggregator(**kwargs)
        assert info.value.field == field

    def test_engine_config_lease_must_be_positive(self) -> None:
        """EngineConfig.transfer_lease_s refuses 0 and accepts math.inf."""
        with pytest.raises(InvalidConfigError, match="transfer_lease_s"):
            EngineConfig(transfer_lease_s=0)
        assert EngineConfig(transfer_lease_s=math.inf).transfer_lease_s == math.inf


# ------------------------------------------------------ the execute and fan_in stages


def pending(step: int) -> StepContext:
    return StepContext(step, None, inputs=(SchedulerOutput(step_id=step),))


async def execute_and_merge(
    agg: FanInAggregator, step: int, waiters: Sequence[Any], timeout_s: float = 300.0
) -> FanInOutput:
    """``execute → fan_in`` of one step over ``waiters``, as the engine graph runs them."""
    ctx = pending(step)
    ctx.put(await ExecuteStage(FakeRanks(waiters), timeout_s=timeout_s).run(ctx))
    merged: FanInOutput = await FanInStage(agg).run(ctx)
    return merged


def answer(rank: int, step: int, **fields: Any) -> Any:
    async def waiter() -> WorkerOutput:
        return WorkerOutput(rank=rank, step_id=step, **fields)

    return waiter


def boom(rank: int, step: int) -> Any:
    report = StepReport(step, rank, "error", 0.0, (), "fault", ())

    async def waiter() -> WorkerOutput:
        raise WorkerFailedError(
            rank, step, f"injected on rank {rank}", report=report
        ) from RuntimeError(f"root cause {rank}")

    return waiter


@pytest.mark.anyio
class TestFanInStage:
    async def test_merges_every_rank(self) -> None:
        """All ranks answering gives the aggregator's merge of their outputs."""
        merged = await execute_and_merge(
            FanInAggregator(2), 3, [answer(0, 3, sampled_token_ids={"x": 1}), answer(1, 3)]
        )
        assert merged.step_id == 3 and merged.sampled_token_ids == {"x": (1,)}
        assert merged.num_ranks == 2

    async def test_several_failing_ranks_are_all_named(self) -> None:
        """Two ranks raising: one WorkerFailedError naming both; describe_failure finds both."""
        with pytest.raises(WorkerFailedError) as info:
            await execute_and_merge(FanInAggregator(W), 4, [boom(0, 4), answer(1, 4), boom(2, 4)])
        error = info.value
        assert error.rank == 0 and "worker rank 0 failed: injected on rank 0" in str(error)
        assert "also failed: rank 2: injected on rank 2" in str(error)
        failure = describe_failure(4, error, None)
        assert failure.ranks == (0, 2)
        assert failure.failed_stages == ("rank0:fault", "rank2:fault")
        assert not failure.cancelled

    async def test_missed_deadline_names_every_silent_rank(self) -> None:
        """Ranks 1 and 2 hanging past timeout_s: the error and the failure name both."""
        with pytest.raises(WorkerFailedError) as info:
            await execute_and_merge(
                FanInAggregator(W), 5, [answer(0, 5), hang(), hang()], timeout_s=0.05
            )
        message = str(info.value)
        assert "worker rank 1 failed" in message and "also failed: rank 2" in message
        assert "deadline" in message
        failure = describe_failure(5, info.value, None)
        assert failure.ranks == (1, 2) and failure.cancelled

    async def test_one_failing_rank_is_raised_as_is(self) -> None:
        """A single failing rank's own error propagates, with its cause kept."""
        with pytest.raises(WorkerFailedError) as info:
            await execute_and_merge(FanInAggregator(2), 1, [answer(0, 1), boom(1, 1)])
        assert info.value.rank == 1 and describe_failure(1, info.value, None).ranks == (1,)

    async def test_reports_of_answering_ranks_survive_a_failed_step(self) -> None:
        """Rank 0's finished send in a failed step still counts toward the release."""
        agg = FanInAggregator(2)
        waiters = [answer(0, 0, finished_sending=frozenset({"a"})), boom(1, 0)]
        graph = engine_graph_over(agg, FakeRanks(waiters))
        with pytest.raises(WorkerFailedError):
            await graph.run(pending(0))
        assert agg.pending_ranks("sending", "a") == {0}
        merged = await execute_and_merge(
            agg, 1, [answer(0, 1), answer(1, 1, finished_sending=frozenset({"a"}))]
        )
        assert merged.finished_sending == {"a"}


def engine_graph_over(agg: FanInAggregator, executor: FakeRanks) -> StepGraph:
    """``execute → fan_in ⟂ fail_step`` of the engine graph, over ``executor``."""
    return StepGraph(
        [
            ExecuteStage(executor),
            FanInStage(agg),
            FailStepStage(make_scheduler(), agg, executor),
        ],
        inputs=(SchedulerOutput,),
        name="engine",
    )


# ------------------------------------------------- what the scheduler does with it


@attrs.frozen
class _Meta(KVConnectorMetadata):
    step_id: int


class _DelayingConnector(KVConnectorScheduler):
    """Delays every free; loads ``async_loads[req_id]`` tokens asynchronously."""

    def __init__(self, async_loads: dict[str, int] | None = None) -> None:
        super().__init__(ConnectorContext(role=KVConnectorRole.SCHEDULER))
        self.async_loads = async_loads or {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        tokens = self.async_loads.get(request.request_id, 0)
        return MatchResult(tokens, load_async=tokens > 0)

    def update_state_after_alloc(self, request: Request, block_ids: Any, num: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return _Meta(scheduler_output.step_id)

    def request_finished(self, request: Request, block_ids: Any) -> RequestFinishedResult:
        return RequestFinishedResult(delay_free=True)


def _update(scheduler: Any, **fields: Any) -> list[Any]:
    so = scheduler.schedule()
    sampled = {item.req_id: 5 for item in so.requests if item.sample}
    return scheduler.update_from_output(
        so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled, **fields)
    )


class TestSchedulerExpiry:
    def test_expired_send_frees_the_delayed_blocks(self) -> None:
        """expired_sending releases the finished request's blocks and counts it."""
        scheduler = make_scheduler(connector=_DelayingConnector())
        scheduler.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1)))
        (done,) = _update(scheduler)
        assert done.finished and scheduler.leak_report()["pending_transfers"] == 1
        _update(scheduler, expired_sending=frozenset({"a"}), missing_ranks={"a": (2,)})
        assert scheduler.leak_report()["pending_transfers"] == 0
        assert scheduler.num_free_blocks == scheduler.num_blocks
        assert scheduler._state.num_expired_sending == 1

    def test_expired_load_fails_that_request_alone(self) -> None:
        """expired_recving fails the parked request with "error" naming the silent ranks."""
        connector = _DelayingConnector({"slow": 4})
        scheduler = make_scheduler(connector=connector)
        scheduler.add_request(Request("slow", list(range(9)), SamplingParams(max_tokens=2)))
        scheduler.add_request(Request("ok", [7, 8, 9], SamplingParams(max_tokens=2)))
        _update(scheduler)
        assert scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        outs = _update(
            scheduler, expired_recving=frozenset({"slow", "ghost"}), missing_ranks={"slow": (1, 2)}
        )
        (failed,) = [o for o in outs if o.request_id == "slow"]
        assert failed.finish_reason == "error" and "rank(s) 1, 2" in (failed.error or "")
        assert "slow" not in scheduler.requests
        ok = [o for o in outs if o.request_id == "ok"]
        assert ok and ok[0].finish_reason == "length"

    def test_expirations_of_unknown_requests_are_dropped(self) -> None:
        """Expired ids the scheduler no longer knows change nothing and raise nothing."""
        scheduler = make_scheduler(connector=_DelayingConnector())
        _update(
            scheduler,
            expired_sending=frozenset({"gone"}),
            expired_recving=frozenset({"gone"}),
            finished_recving=frozenset({"gone"}),
        )
        assert not any(scheduler.leak_report().values())


# --------------------------------------------------------- stateful property test


REQS = ("r0", "r1", "r2", "r3")
KINDS = ("sending", "recving")
LEASE_STEPS = 3
LEASE_S = 1.0


@attrs.define
class _ModelEntry:
    ranks: set[int]
    step: int
    time: float


class AggregatorMachine(RuleBasedStateMachine):
    """The aggregator against a plain model, with reports in any order across steps."""

    @initialize()
    def start(self) -> None:
        self.agg = FanInAggregator(W, lease_steps=LEASE_STEPS, lease_s=LEASE_S)
        self.step = 0
        self.now = 0.0
        self.buffer: list[tuple[int, str, str]] = []  # (rank, kind, req) for the next step
        self.errors: dict[int, set[int]] = {}
        self.entries: dict[tuple[str, str], _ModelEntry] = {}
        self.forgotten: dict[str, _ModelEntry] = {}
        # Ranks heard per (kind, req) since its entry was opened (independent bookkeeping).
        self.heard: dict[tuple[str, str], set[int]] = {}

    @rule(rank=st.integers(0, W - 1), kind=st.sampled_from(KINDS), req=st.sampled_from(REQS))
    def report(self, rank: int, kind: str, req: str) -> None:
        self.buffer.append((rank, kind, req))

    @rule(kind=st.sampled_from(KINDS), req=st.sampled_from(REQS))
    def every_rank_reports(self, kind: str, req: str) -> None:
        self.buffer.extend((rank, kind, req) for rank in range(W))

    @rule(rank=st.integers(0, W - 1), block=st.integers(0, 20))
    def load_error(self, rank: int, block: int) -> None:
        self.errors.setdefault(rank, set()).add(block)

    @rule(req=st.sampled_from(REQS))
    def forget(self, req: str) -> None:
        self.agg.forget([req], now=self.now)
        for kind in ("sending", "recving"):
            self.entries.pop((kind, req), None)
            self.heard.pop((kind, req), None)
        self.forgotten[req] = _ModelEntry(set(), self.step, self.now)

    def _outputs(self, data: st.DataObject) -> list[WorkerOutput]:
        outputs = []
        for rank in range(W):
            mine = [(k, r) for rank_, k, r in self.buffer if rank_ == rank]
            outputs.append(
                WorkerOutput(
                    rank=rank,
                    step_id=self.step,
                    finished_sending=frozenset(r for k, r in mine if k == "sending"),
                    finished_recving=frozenset(r for k, r in mine if k == "recving"),
                    invalid_block_ids=frozenset(self.errors.get(rank, ())),
                )
            )
        return data.draw(st.permutations(outputs))

    def _absorb(self) -> None:
        for rank, kind, req in self.buffer:
            if kind == "recving" and req in self.forgotten:
                continue
            entry = self.entries.setdefault((kind, req), _ModelEntry(set(), self.step, self.now))
            entry.ranks.add(rank)
            self.heard.setdefault((kind, req), set()).add(rank)
        self.buffer.clear()
        self.errors.clear()

    def _over(self, entry: _ModelEntry) -> bool:
        return self.step - entry.step >= LEASE_STEPS or self.now - entry.time >= LEASE_S

    def _advance(self, steps: int, dt: float) -> None:
        self.step += steps
        self.now += dt

    @rule(data=st.data(), steps=st.integers(1, 2), dt=st.sampled_from([0.0, 0.25, 0.6]))
    def merge(self, data: st.DataObject, steps: int, dt: float) -> None:
        self._advance(steps, dt)
        union = set().union(*self.errors.values()) if self.errors else set()
        merged = self.agg.merge(self.step, self._outputs(data), now=self.now)
        self._absorb()
        assert merged.invalid_block_ids == union
        self._check_release(merged)

    @rule(data=st.data(), steps=st.integers(1, 2), dt=st.sampled_from([0.0, 0.6]))
    def failed_step(self, data: st.DataObject, steps: int, dt: float) -> None:
        self._advance(steps, dt)
        self.agg.record(self.step, self._outputs(data), now=self.now)
        self._absorb()

    @precondition(lambda self: not self.buffer)
    @rule()
    def idle_past_the_lease(self) -> None:
        """No entry is kept forever: one lease without reports drains everything."""
        self._advance(LEASE_STEPS, LEASE_S)
        merged = self.agg.merge(self.step, [], now=self.now)
        self._check_release(merged)
        assert self.agg.num_pending == 0

    def _check_release(self, merged: FanInOutput) -> None:
        expected_done: dict[str, set[str]] = {"sending": set(), "recving": set()}
        expected_expired: dict[str, set[str]] = {"sending": set(), "recving": set()}
        missing: dict[str, set[int]] = {}
        for (kind, req), entry in list(self.entries.items()):
            if len(entry.ranks) == W:
                expected_done[kind].add(req)
            elif self._over(entry):
                expected_expired[kind].add(req)
                missing.setdefault(req, set()).update(set(range(W)) - entry.ranks)
            else:
                continue
            del self.entries[(kind, req)]
        assert merged.finished_sending == expected_done["sending"]
        assert merged.finished_recving == expected_done["recving"]
        assert merged.expired_sending == expected_expired["sending"]
        assert merged.expired_recving == expected_expired["recving"]
        assert merged.missing_ranks == {r: tuple(sorted(m)) for r, m in missing.items()}
        for kind in ("sending", "recving"):
            for req in getattr(merged, f"finished_{kind}"):
                # Finished only after every rank reported since the entry opened.
                assert self.heard.pop((kind, req)) == set(range(W))
            for req in getattr(merged, f"expired_{kind}"):
                assert self.heard.pop((kind, req)) != set(range(W))
        self.forgotten = {r: e for r, e in self.forgotten.items() if not self._over(e)}

    @invariant()
    def pending_matches_the_model(self) -> None:
        if not hasattr(self, "agg"):
            return
        assert self.agg.num_pending == len(self.entries)
        for (kind, req), entry in self.entries.items():
            assert self.agg.pending_ranks(kind, req) == entry.ranks  # type: ignore[arg-type]


TestAggregatorStateMachine = AggregatorMachine.TestCase
TestAggregatorStateMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
