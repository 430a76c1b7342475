"""Tests of fault injection: Fault specs, the "faulty" connector and the fault stage."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import anyio
import attrs
import msgspec
import pytest
import structlog

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorOutput,
    KVConnectorRole,
    MatchResult,
    WorkerFinished,
)
from connectors.lifecycle import GuardedWorker
from connectors.registry import create_connector, get_connector
from connectors.testing import (
    CALLS,
    MAX_SYNC_HANG_S,
    Fault,
    FaultStage,
    FaultyConnector,
    RecordingConnector,
    RecordingMetadata,
    check_lifecycle,
)
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.errors import FaultInjected, GraphError, InvalidConfigError, UnknownConnectorError
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from pipeline.request import Request

WORKER = KVConnectorRole.WORKER
SCHEDULER = KVConnectorRole.SCHEDULER
KV: Any = None  # the recording connector ignores the KV tensor


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    RecordingConnector.reset()
    FaultyConnector.reset()
    yield
    RecordingConnector.reset()
    FaultyConnector.reset()


def _options(*faults: dict[str, Any] | Fault, **extra: Any) -> dict[str, Any]:
    return {"inner": "recording", "faults": list(faults), **extra}


def _worker(*faults: dict[str, Any] | Fault, rank: int = 0) -> FaultyConnector.Worker:
    ctx = ConnectorContext(role=WORKER, options=_options(*faults), rank=rank, world_size=4)
    worker = create_connector("faulty", WORKER, ctx)
    assert isinstance(worker, FaultyConnector.Worker)
    return worker


def _scheduler(*faults: dict[str, Any] | Fault) -> FaultyConnector.Scheduler:
    ctx = ConnectorContext(role=SCHEDULER, options=_options(*faults), block_size=4)
    scheduler = create_connector("faulty", SCHEDULER, ctx)
    assert isinstance(scheduler, FaultyConnector.Scheduler)
    return scheduler


def _scheduled(req_id: str, block_ids: tuple[int, ...]) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=(1, 2, 3),
        num_computed_tokens=0,
        block_ids=block_ids,
        new=bool(block_ids),
        sampling=SamplingParams(),
        sample=True,
        num_output_tokens=0,
    )


def _output(step_id: int = 3) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        requests=(_scheduled("a", ()), _scheduled("b", (7, 8)), _scheduled("c", (9,))),
        finished_req_ids=frozenset({"gone"}),
        kv_connector_metadata=RecordingMetadata(step_id, ("a", "b", "c")),
    )


def _forward(step_id: int = 3, rank: int = 0) -> ForwardContext:
    return ForwardContext(
        step_id=step_id, rank=rank, kv_caches=(), scheduler_output=_output(step_id)
    )


def _request(req_id: str = "r", n: int = 6) -> Request:
    return Request(req_id, list(range(1, n + 1)), SamplingParams())


async def _step(worker: Any, step_id: int = 3, rank: int = 0) -> tuple[frozenset[str], Any]:
    """One full worker step with ``step_id`` bound, as the engine runs it."""
    with structlog.contextvars.bound_contextvars(step_id=step_id):
        if isinstance(worker, GuardedWorker):
            worker.begin_step(step_id)
        try:
            worker.bind_connector_metadata(_output(step_id).kv_connector_metadata)
            await worker.start_load_kv(_forward(step_id, rank))
            for layer in range(2):
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer, KV, _forward(step_id, rank))
            failed = await worker.wait_for_save()
            finished = await worker.get_finished(frozenset({"gone"}))
            worker.get_block_ids_with_load_errors()
            worker.get_kv_stats()
        finally:
            worker.clear_connector_metadata()
    return failed, finished


def _inner_methods(step_id: int | None = None) -> list[str]:
    return RecordingConnector.methods(step_id=step_id)


class TestFaultSpec:
    def test_round_trips_through_msgspec(self) -> None:
        """A fault is plain data: msgpack and JSON give it back equal."""
        fault = Fault(call="wait_for_save", action="raise", step=3, rank=1, times=None)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(fault), type=Fault) == fault
        assert msgspec.json.decode(msgspec.json.encode(fault), type=Fault) == fault
        assert Fault.coerce(fault.to_dict()) == fault

    def test_unknown_call_lists_the_allowed_calls(self) -> None:
        """An unknown call name is refused with every allowed name in the message."""
        with pytest.raises(InvalidConfigError) as info:
            Fault(call="wait_for_saves", action="raise")
        assert info.value.value == "wait_for_saves"
        for call in CALLS:
            assert call in str(info.value)

    @pytest.mark.parametrize(
        ("call", "action", "allowed"),
        [
            ("bind_connector_metadata", "hang", "raise"),
            ("clear_connector_metadata", "cancel", "raise"),
            ("save_kv_layer", "cancel", "raise, hang"),
            ("start_load_kv", "corrupt", "raise, hang, cancel"),
            ("get_num_new_matched_tokens", "hang", "raise, corrupt"),
        ],
    )
    def test_action_the_call_does_not_allow_is_refused(
        self, call: str, action: str, allowed: str
    ) -> None:
        """Hang only where a deadline or a bound can cut it, cancel only in async calls,
        corrupt only where data is returned; the message lists what the call allows."""
        with pytest.raises(InvalidConfigError, match=f"{call} allows: {allowed}$"):
            Fault(call=call, action=action)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("step", -1),
            ("rank", "1"),
            ("times", 0),
            ("times", True),
            ("hang_s", math.inf),
            ("hang_s", -0.5),
            ("layer", 2),  # wait_for_save takes no layer
        ],
    )
    def test_bad_field_is_refused_naming_it(self, field: str, value: object) -> None:
        """Each numeric field is checked; the error names the field and the value."""
        with pytest.raises(InvalidConfigError) as info:
            Fault(call="wait_for_save", action="raise", **{field: value})  # type: ignore[arg-type]
        assert info.value.field == f"fault {field}" and info.value.value == value

    def test_decoding_validates_too(self) -> None:
        """A fault decoded from JSON is validated like a constructed one."""
        with pytest.raises(msgspec.ValidationError, match="must be one of"):
            msgspec.json.decode(b'{"call": "nope", "action": "raise"}', type=Fault)

    @pytest.mark.parametrize(
        ("value", "match"),
        [
            ({"call": "wait_for_save", "action": "raise", "when": 3}, "fault key='when'"),
            ({"call": "wait_for_save"}, "needs both 'call' and 'action'"),
            (["wait_for_save", "raise"], "must be a Fault or a mapping"),
        ],
    )
    def test_coerce_refuses_what_is_not_a_fault(self, value: object, match: str) -> None:
        """A mapping with an unknown key or a missing field, or a non-mapping, is refused."""
        with pytest.raises(InvalidConfigError, match=match):
            Fault.coerce(value)


class TestOptions:
    def test_faulty_is_a_builtin(self) -> None:
        """The registry finds "faulty" without an import by the caller."""
        spec = get_connector("faulty")
        assert spec.worker_cls is FaultyConnector.Worker

    @pytest.mark.parametrize(
        ("options", "match"),
        [
            ({"inner": "recording", "fault": []}, "key='fault'.*faults, inner, inner_options"),
            ({"faults": []}, r"connector_options\['inner'\]=None"),
            ({"inner": ""}, "must name the registered connector"),
            ({"inner": "recording", "inner_options": [1]}, "must be a mapping"),
            ({"inner": "recording", "faults": {"call": "x"}}, "must be a list of faults"),
            ({"inner": "recording", "faults": [{"call": "x", "action": "raise"}]}, "call='x'"),
        ],
    )
    @pytest.mark.parametrize("role", [WORKER, SCHEDULER])
    def test_bad_options_are_refused(
        self, role: KVConnectorRole, options: dict[str, Any], match: str
    ) -> None:
        """Options are checked when a half is built; errors name the value and the choices."""
        with pytest.raises(InvalidConfigError, match=match):
            create_connector("faulty", role, ConnectorContext(role=role, options=options))

    def test_unknown_inner_lists_registered_connectors(self) -> None:
        """An inner name nobody registered raises UnknownConnectorError."""
        ctx = ConnectorContext(role=WORKER, options={"inner": "nope"})
        with pytest.raises(UnknownConnectorError, match=r"registered: .*recording"):
            create_connector("faulty", WORKER, ctx)

    def test_inner_gets_its_own_options(self) -> None:
        """The inner half is built with ``inner_options``, everything else unchanged."""
        ctx = ConnectorContext(
            role=WORKER, options=_options(inner_options={"x": 1}), rank=2, world_size=3
        )
        worker = create_connector("faulty", WORKER, ctx)
        assert isinstance(worker, FaultyConnector.Worker)
        assert worker.inner.context == attrs.evolve(ctx, options={"x": 1})


class TestForwarding:
    @pytest.mark.anyio
    async def test_worker_without_faults_forwards_every_call(self) -> None:
        """Behind the guard, every call of a step reaches the inner connector in order."""
        guarded = GuardedWorker(_worker())
        await _step(guarded)
        assert _inner_methods(3) == [
            "bind_connector_metadata",
            "start_load_kv",
            "wait_for_layer_load",
            "save_kv_layer",
            "wait_for_layer_load",
            "save_kv_layer",
            "wait_for_save",
            "get_finished",
            "get_block_ids_with_load_errors",
            "get_kv_stats",
            "clear_connector_metadata",
        ]
        assert check_lifecycle(RecordingConnector.calls) == []
        assert FaultyConnector.fired == []

    def test_metadata_is_the_inner_halfs(self) -> None:
        """connector_metadata is what the inner half bound, and None after the clear."""
        worker = _worker()
        meta = RecordingMetadata(1, ("a",))
        worker.bind_connector_metadata(meta)
        assert worker.connector_metadata is meta is worker.inner.connector_metadata
        worker.clear_connector_metadata()
        assert worker.connector_metadata is None

    def test_scheduler_without_faults_forwards_every_call(self) -> None:
        """Every scheduler call reaches the inner half and its answer comes back."""
        scheduler = _scheduler()
        request = _request()
        assert scheduler.get_num_new_matched_tokens(request, 0) == MatchResult(0, False)
        scheduler.update_state_after_alloc(request, [1], 0)
        assert scheduler.build_connector_meta(_output(0)) == RecordingMetadata(0, ("a", "b", "c"))
        scheduler.request_finished(request, [1])
        scheduler.update_connector_output(KVConnectorOutput())
        assert scheduler.has_pending_work() is False
        assert [c.method for c in RecordingConnector.scheduler_calls()] == [
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "request_finished",
            "update_connector_output",
            "has_pending_work",
        ]


_WORKER_STEP_CALLS = [
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_stats",
]


class TestRaise:
    @pytest.mark.anyio
    @pytest.mark.parametrize("call", _WORKER_STEP_CALLS)
    async def test_worker_call_raises_instead_of_forwarding(self, call: str) -> None:
        """The faulted call raises FaultInjected naming call, step and rank; the inner
        connector never sees it; the step's clear still reaches it."""
        worker = _worker({"call": call, "action": "raise", "step": 3, "rank": 2}, rank=2)
        with pytest.raises(FaultInjected) as info:
            await _step(worker, 3, rank=2)
        assert (info.value.call, info.value.step, info.value.rank) == (call, 3, 2)
        methods = _inner_methods(3)
        assert call not in methods and methods[-1] == "clear_connector_metadata"
        assert worker.connector_metadata is None

    @pytest.mark.anyio
    async def test_clear_raises_after_clearing(self) -> None:
        """A clear fault lets the inner clear run first: the metadata is gone anyway."""
        guarded = GuardedWorker(_worker({"call": "clear_connector_metadata", "action": "raise"}))
        with pytest.raises(FaultInjected, match="clear_connector_metadata"):
            await _step(guarded)
        assert _inner_methods(3)[-1] == "clear_connector_metadata"
        assert guarded.connector_metadata is None
        assert guarded.last_call == "clear_connector_metadata"  # the next step may begin

    @pytest.mark.anyio
    async def test_outside_a_step_the_step_is_none(self) -> None:
        """register_kv_caches and aclose run outside steps: the fault reports step None."""
        worker = _worker(
            {"call": "register_kv_caches", "action": "raise"},
            {"call": "aclose", "action": "raise"},
        )
        with pytest.raises(FaultInjected) as info:
            worker.register_kv_caches([])
        assert info.value.step is None
        with pytest.raises(FaultInjected, match="aclose"):
            await worker.aclose()

    @pytest.mark.parametrize(
        "call",
        [
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "request_finished",
            "update_connector_output",
            "has_pending_work",
        ],
    )
    def test_scheduler_call_raises(self, call: str) -> None:
        """Each scheduler call raises when faulted, rank 0, the bound step."""
        scheduler = _scheduler({"call": call, "action": "raise"})
        args: dict[str, tuple[Any, ...]] = {
            "get_num_new_matched_tokens": (_request(), 0),
            "update_state_after_alloc": (_request(), [1], 0),
            "build_connector_meta": (_output(5),),
            "request_finished": (_request(), [1]),
            "update_connector_output": (KVConnectorOutput(),),
            "has_pending_work": (),
        }
        with (
            structlog.contextvars.bound_contextvars(step_id=5),
            pytest.raises(FaultInjected) as info,
        ):
            getattr(scheduler, call)(*args[call])
        assert (info.value.call, info.value.step, info.value.rank) == (call, 5, 0)
        assert RecordingConnector.scheduler_calls() == []


class TestHang:
    @pytest.mark.anyio
    @pytest.mark.parametrize("call", ["start_load_kv", "wait_for_save", "get_finished"])
    async def test_async_hang_is_cut_by_a_deadline(self, call: str) -> None:
        """A long hang in an async call is cancelled by the caller's deadline; the inner
        call never happens."""
        worker = _worker({"call": call, "action": "hang", "hang_s": 30})
        with anyio.move_on_after(0.05) as scope:
            await _step(worker)
        assert scope.cancelled_caught
        assert call not in _inner_methods(3)
        assert _inner_methods(3)[-1] == "clear_connector_metadata"

    @pytest.mark.anyio
    async def test_short_hang_delays_then_forwards(self) -> None:
        """A hang that is not cut is a slow call: the call is forwarded afterwards."""
        worker = _worker({"call": "wait_for_save", "action": "hang", "hang_s": 0.01})
        await _step(worker)
        assert "wait_for_save" in _inner_methods(3)
        assert [f.call for f in FaultyConnector.fired] == ["wait_for_save"]

    @pytest.mark.parametrize(("hang_s", "slept"), [(0.01, 0.01), (600.0, MAX_SYNC_HANG_S)])
    @pytest.mark.parametrize("call", ["wait_for_layer_load", "save_kv_layer"])
    def test_layer_hook_hang_sleeps_bounded_then_forwards(
        self, monkeypatch: pytest.MonkeyPatch, call: str, hang_s: float, slept: float
    ) -> None:
        """In the forward thread a hang is a bounded time.sleep, then the hook runs."""
        sleeps: list[float] = []
        monkeypatch.setattr("connectors.testing.fault_spec.time.sleep", sleeps.append)
        worker = _worker({"call": call, "action": "hang", "hang_s": hang_s, "layer": 1})
        for layer in range(3):
            if call == "save_kv_layer":
                worker.save_kv_layer(layer, KV, _forward())
            else:
                worker.wait_for_layer_load(layer)
        assert sleeps == [slept]
        assert [c.layer for c in RecordingConnector.worker_calls()] == [0, 1, 2]


class TestCancel:
    @pytest.mark.anyio
    @pytest.mark.parametrize("call", ["start_load_kv", "wait_for_save", "get_finished", "aclose"])
    async def test_async_call_cancels_its_task(self, call: str) -> None:
        """The task making the call is cancelled natively; the call never reaches the
        inner connector and the CancelledError propagates out of the task."""
        worker = _worker({"call": call, "action": "cancel"})

        async def make_call() -> None:
            if call == "aclose":
                await worker.aclose()
            else:
                await _step(worker)

        task = asyncio.ensure_future(make_call())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert call not in _inner_methods()

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["trio"])
    async def test_under_trio_it_raises_instead(self, anyio_backend: str) -> None:
        """trio has no native task cancel: the fault raises FaultInjected (action cancel)."""
        worker = _worker({"call": "wait_for_save", "action": "cancel"})
        with pytest.raises(FaultInjected) as info:
            await _step(worker)
        assert info.value.action == "cancel"


class TestCorrupt:
    @pytest.mark.anyio
    async def test_worker_answers_are_corrupted(self) -> None:
        """wait_for_save fails every request of the step; get_finished adds an unknown id
        and the ids the scheduler already finished; load errors name the first listed
        request's blocks."""
        worker = _worker(
            {"call": "wait_for_save", "action": "corrupt"},
            {"call": "get_finished", "action": "corrupt"},
            {"call": "get_block_ids_with_load_errors", "action": "corrupt"},
        )
        with structlog.contextvars.bound_contextvars(step_id=3):
            worker.bind_connector_metadata(_output().kv_connector_metadata)
            await worker.start_load_kv(_forward())
            assert await worker.wait_for_save() == {"a", "b", "c"}
            finished = await worker.get_finished(frozenset({"gone"}))
            assert worker.get_block_ids_with_load_errors() == {7, 8}
            worker.clear_connector_metadata()
        bogus = {"faulty-unknown-3", "gone"}
        assert finished == WorkerFinished(sending=frozenset(bogus), recving=frozenset(bogus))
        assert [f.fault.action for f in FaultyConnector.fired] == ["corrupt"] * 3

    def test_matched_tokens_claim_more_than_the_request_has(self) -> None:
        """The corrupt match claims a block more than the request's tokens, loaded now."""
        scheduler = _scheduler({"call": "get_num_new_matched_tokens", "action": "corrupt"})
        request = _request(n=6)
        assert scheduler.get_num_new_matched_tokens(request, 0) == MatchResult(10, False)
        assert scheduler.get_num_new_matched_tokens(request, 0) == MatchResult(0, False)

    def test_metadata_is_the_previous_steps(self) -> None:
        """A corrupt build returns the previous call's metadata (unchanged on the first)."""
        scheduler = _scheduler({"call": "build_connector_meta", "action": "corrupt", "times": 2})
        first = scheduler.build_connector_meta(_output(0))
        assert first == RecordingMetadata(0, ("a", "b", "c"))
        assert scheduler.build_connector_meta(_output(1)) == first

    def test_pending_work_is_claimed(self) -> None:
        """A corrupt has_pending_work says there is work; the next call does not."""
        scheduler = _scheduler({"call": "has_pending_work", "action": "corrupt"})
        assert [scheduler.has_pending_work() for _ in range(2)] == [True, False]


class TestMatching:
    @pytest.mark.anyio
    async def test_step_rank_and_times_select_the_calls(self) -> None:
        """A fault fires only in its step, on its rank, as many times as it may."""
        fault = {"call": "wait_for_save", "action": "raise", "step": 4, "rank": 1}
        other_rank, right_rank = _worker(fault, rank=0), _worker(fault, rank=1)
        await _step(other_rank, 4, rank=0)
        await _step(right_rank, 3, rank=1)
        with pytest.raises(FaultInjected):
            await _step(right_rank, 4, rank=1)
        await _step(right_rank, 4, rank=1)  # times=1: used up
        assert [(f.step, f.rank) for f in FaultyConnector.fired] == [(4, 1)]

    @pytest.mark.anyio
    async def test_times_none_fires_on_every_match(self) -> None:
        """``times=None`` fires at every matching call."""
        worker = _worker({"call": "get_kv_stats", "action": "raise", "times": None})
        for step in range(3):
            with pytest.raises(FaultInjected):
                await _step(worker, step)
        assert [f.step for f in FaultyConnector.fired] == [0, 1, 2]

    def test_layer_selects_the_hook_call(self) -> None:
        """A layer fault fires at that layer only."""
        worker = _worker({"call": "wait_for_layer_load", "action": "raise", "layer": 1})
        worker.wait_for_layer_load(0)
        with pytest.raises(FaultInjected):
            worker.wait_for_layer_load(1)
        worker.wait_for_layer_load(1)
        assert [c.layer for c in RecordingConnector.worker_calls()] == [0, 1]

    def test_first_matching_fault_with_firings_left_wins(self) -> None:
        """Faults are tried in order; a used-up fault lets the next one fire."""
        scheduler = _scheduler(
            {"call": "has_pending_work", "action": "corrupt"},
            {"call": "has_pending_work", "action": "raise"},
        )
        assert scheduler.has_pending_work() is True
        with pytest.raises(FaultInjected):
            scheduler.has_pending_work()
        assert scheduler.has_pending_work() is False


class Marker:
    """The marker a FaultStage provides in these tests."""


class TestFaultStage:
    def _graph(self, stage: FaultStage) -> StepGraph:
        return StepGraph([stage], inputs=(SchedulerOutput,), name="t")

    @pytest.mark.anyio
    async def test_raises_at_its_step_and_rank_only(self) -> None:
        """It raises FaultInjected naming the stage in its step on its rank, else passes."""
        stage = FaultStage(action="raise", requires=(SchedulerOutput,), step=2, rank=1)
        graph = self._graph(stage)
        for step, rank in ((1, 1), (2, 0)):
            await graph.run(StepContext(step, rank, inputs=(_output(step),)))
        with pytest.raises(FaultInjected) as info:
            await graph.run(StepContext(2, 1, inputs=(_output(2),)))
        assert (info.value.call, info.value.step, info.value.rank) == ("stage fault", 2, 1)
        await graph.run(StepContext(2, 1, inputs=(_output(2),)))  # times=1: used up
        assert stage.fired == [(2, 1)]

    @pytest.mark.anyio
    async def test_provides_its_marker_when_it_passes(self) -> None:
        """With a marker class, a passing step stores an instance of it."""
        stage = FaultStage(action="hang", hang_s=0.0, provides=Marker, name="m")
        ctx = StepContext(0, 0)
        await StepGraph([stage], name="t").run(ctx)
        assert isinstance(ctx.get(Marker), Marker)

    @pytest.mark.anyio
    async def test_hang_is_cut_by_a_deadline(self) -> None:
        """A hanging fault stage is cancelled by the caller's deadline."""
        graph = self._graph(FaultStage(action="hang", hang_s=30))
        with anyio.move_on_after(0.05) as scope:
            await graph.run(StepContext(0, 0, inputs=(_output(0),)))
        assert scope.cancelled_caught

    @pytest.mark.anyio
    async def test_cancel_cancels_the_task_running_the_step(self) -> None:
        """The step's task is cancelled natively and the cancellation propagates."""
        graph = self._graph(FaultStage(action="cancel"))
        ctx = StepContext(0, 0, inputs=(_output(0),))
        task = asyncio.ensure_future(graph.run(ctx))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ctx.cancelled and ctx.report is not None and ctx.report.outcome == "cancelled"

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"action": "corrupt"}, "fault action"),
            ({"action": "raise", "step": -1}, "fault step"),
            ({"action": "raise", "times": 0}, "fault times"),
            ({"action": "hang", "hang_s": math.nan}, "fault hang_s"),
            ({"action": "raise", "provides": "Marker"}, "fault provides"),
        ],
    )
    def test_bad_options_are_refused(self, kwargs: dict[str, Any], field: str) -> None:
        """Options are checked on construction, naming the field."""
        with pytest.raises(InvalidConfigError) as info:
            FaultStage(**kwargs)
        assert info.value.field == field

    def test_two_instances_need_two_names(self) -> None:
        """Two fault stages in one graph must be told apart by name."""
        with pytest.raises(GraphError, match="two stages are named 'fault'"):
            StepGraph([FaultStage(action="raise"), FaultStage(action="hang")], name="t")
