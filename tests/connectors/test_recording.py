"""Tests of the recording connector and the lifecycle checker (connectors.testing)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import structlog

from connectors.base import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    MatchResult,
    RequestFinishedResult,
    WorkerFinished,
)
from connectors.lifecycle import GuardedWorker
from connectors.registry import create_connector
from connectors.testing import (
    ConnectorCall,
    RecordingConnector,
    RecordingMetadata,
    check_lifecycle,
)
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.request import Request

CTX: Any = None  # the recording worker ignores the ForwardContext
KV: Any = None  # nor the KV tensor


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    RecordingConnector.reset()
    yield
    RecordingConnector.reset()


def _scheduler(rank: int = 0) -> RecordingConnector.Scheduler:
    ctx = ConnectorContext(role=KVConnectorRole.SCHEDULER, rank=rank)
    return RecordingConnector.Scheduler(ctx)


def _worker(rank: int = 0) -> RecordingConnector.Worker:
    return RecordingConnector.Worker(ConnectorContext(role=KVConnectorRole.WORKER, rank=rank))


def _request(req_id: str) -> Request:
    return Request(req_id, [1, 2, 3], SamplingParams())


def _scheduled(req_id: str) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=(1, 2, 3),
        num_computed_tokens=0,
        block_ids=(0,),
        new=True,
        sampling=SamplingParams(),
        sample=True,
        num_output_tokens=0,
    )


def _run_step(worker: Any, step_id: int, layers: int = 2) -> None:
    """One full worker step with step_id bound in contextvars, as the engine does it."""

    async def step() -> None:
        with structlog.contextvars.bound_contextvars(step_id=step_id):
            if isinstance(worker, GuardedWorker):
                worker.begin_step(step_id)
            worker.bind_connector_metadata(RecordingMetadata(step_id, ("r",)))
            await worker.start_load_kv(CTX)
            for layer in range(layers):
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer, KV, CTX)
            await worker.wait_for_save()
            await worker.get_finished(frozenset())
            worker.get_block_ids_with_load_errors()
            worker.get_kv_stats()
            worker.clear_connector_metadata()

    anyio.run(step)


def _w(method: str, step_id: int | None = 1, rank: int = 0, **kw: Any) -> ConnectorCall:
    return ConnectorCall(role="worker", rank=rank, step_id=step_id, method=method, **kw)


GOOD_STEP = [
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
]


class TestRecordingScheduler:
    def test_records_each_call_with_rank_and_step_from_contextvars(self) -> None:
        """Every scheduler call is recorded with the bound step_id and context rank."""
        sched = _scheduler(rank=0)
        req = _request("a")
        out = SchedulerOutput(step_id=4, requests=(_scheduled("a"),))
        with structlog.contextvars.bound_contextvars(step_id=4):
            assert sched.get_num_new_matched_tokens(req, 16) == MatchResult(0, False)
            sched.update_state_after_alloc(req, [1, 2], 0)
            meta = sched.build_connector_meta(out)
            assert sched.request_finished(req, [1, 2]) == RequestFinishedResult()
            sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({"b"})))
            assert sched.has_pending_work() is False
        assert meta == RecordingMetadata(4, ("a",))
        calls = RecordingConnector.scheduler_calls()
        assert [c.method for c in calls] == [
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "request_finished",
            "update_connector_output",
            "has_pending_work",
        ]
        assert {(c.role, c.rank, c.step_id) for c in calls} == {("scheduler", 0, 4)}
        assert calls[0].req_id == "a" and calls[0].num_tokens == 16
        assert calls[2].req_ids == ("a",)
        assert calls[4].req_ids == ("b",)

    def test_step_id_is_none_without_contextvars(self) -> None:
        """Outside a step (nothing bound) the record's step_id is None."""
        _scheduler().has_pending_work()
        assert RecordingConnector.calls[0].step_id is None

    def test_metadata_of_an_empty_step(self) -> None:
        """A step with nothing scheduled still builds metadata naming the step."""
        meta = _scheduler().build_connector_meta(SchedulerOutput(step_id=9))
        assert meta == RecordingMetadata(9, ())


class TestRecordingWorker:
    def test_records_every_method_with_rank_and_step(self) -> None:
        """A full step records each worker call, layer hooks with their layer."""
        worker = _worker(rank=1)
        worker.register_kv_caches([])
        _run_step(worker, step_id=3)
        anyio.run(worker.aclose)
        methods = [c.method for c in RecordingConnector.calls]
        assert methods == [
            "register_kv_caches",
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
            "aclose",
        ]
        step = RecordingConnector.worker_calls(rank=1, step_id=3)
        assert len(step) == len(methods) - 2
        assert {(c.role, c.rank) for c in step} == {("worker", 1)}
        assert [c.layer for c in step if c.method == "save_kv_layer"] == [0, 1]
        assert step[0].meta_step_id == 3 and step[0].req_ids == ("r",)

    def test_metadata_is_none_after_clear(self) -> None:
        """The worker keeps base-class behaviour: bound until clear, None afterwards."""
        worker = _worker()
        meta = RecordingMetadata(1)
        worker.bind_connector_metadata(meta)
        assert worker.connector_metadata is meta
        worker.clear_connector_metadata()
        assert worker.connector_metadata is None

    def test_step_id_reaches_a_forward_thread(self) -> None:
        """Layer hooks on a worker thread see the step_id bound on the event loop."""
        worker = _worker()

        async def main() -> None:
            with structlog.contextvars.bound_contextvars(step_id=12):
                await anyio.to_thread.run_sync(worker.wait_for_layer_load, 5)

        anyio.run(main)
        assert RecordingConnector.calls == [
            ConnectorCall(role="worker", rank=0, step_id=12, method="wait_for_layer_load", layer=5)
        ]

    def test_concurrent_hooks_lose_no_record(self) -> None:
        """Hooks of several ranks on several threads are all recorded."""
        workers = [_worker(rank) for rank in range(4)]

        def hooks(worker: RecordingConnector.Worker) -> None:
            for layer in range(500):
                worker.save_kv_layer(layer, KV, CTX)

        threads = [threading.Thread(target=hooks, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(RecordingConnector.calls) == 2000
        for rank in range(4):
            layers = [c.layer for c in RecordingConnector.worker_calls(rank=rank)]
            assert layers == list(range(500))

    def test_get_finished_records_the_finished_requests(self) -> None:
        """get_finished records the requests it was told about and reports none done."""
        worker = _worker()
        result = anyio.run(worker.get_finished, frozenset({"b", "a"}))
        assert result == WorkerFinished()
        assert RecordingConnector.calls[0].req_ids == ("a", "b")

    def test_registered_as_recording(self) -> None:
        """create_connector("recording", ...) builds the recording halves."""
        ctx = ConnectorContext(role=KVConnectorRole.WORKER, rank=2)
        assert isinstance(create_connector("recording", "worker", ctx), RecordingConnector.Worker)


class TestRecordingMetadata:
    def test_round_trips_through_bytes(self) -> None:
        """to_bytes/from_bytes give back an equal metadata object, without pickle."""
        meta = RecordingMetadata(7, ("a", "b"))
        data = meta.to_bytes()
        assert isinstance(data, bytes) and b"step_id" in data
        back = RecordingMetadata.from_bytes(data)
        assert back == meta
        assert isinstance(back, RecordingMetadata)
        assert isinstance(back, KVConnectorMetadata)

    def test_is_frozen(self) -> None:
        """Metadata is immutable once built."""
        meta = RecordingMetadata(1)
        with pytest.raises(AttributeError):
            meta.step_id = 2  # type: ignore[misc]


class TestRecordingHelpers:
    def test_reset_empties_in_place(self) -> None:
        """reset() empties the list that callers may hold a reference to."""
        calls = RecordingConnector.calls
        _scheduler().has_pending_work()
        RecordingConnector.reset()
        assert calls == [] and RecordingConnector.calls is calls

    def test_filters_and_steps(self) -> None:
        """worker_calls filters by rank and step; steps() lists the steps seen."""
        _run_step(_worker(rank=0), step_id=1)
        _run_step(_worker(rank=1), step_id=1)
        _run_step(_worker(rank=0), step_id=2, layers=0)
        assert RecordingConnector.steps() == [1, 2]
        assert len(RecordingConnector.worker_calls(step_id=1)) == 2 * len(
            RecordingConnector.worker_calls(rank=1)
        )
        assert RecordingConnector.methods(rank=0, step_id=2) == [
            "bind_connector_metadata",
            "start_load_kv",
            "wait_for_save",
            "get_finished",
            "get_block_ids_with_load_errors",
            "get_kv_stats",
            "clear_connector_metadata",
        ]
        assert RecordingConnector.scheduler_calls() == []


class TestCheckLifecycle:
    def test_real_steps_through_the_guard_are_clean(self) -> None:
        """Calls recorded behind the guard, over steps and ranks, have no violation."""
        guards = [GuardedWorker(_worker(rank)) for rank in range(2)]
        for step_id in range(3):
            for guard in guards:
                _run_step(guard, step_id, layers=step_id)
        assert check_lifecycle(RecordingConnector.calls) == []

    @pytest.mark.parametrize(
        "methods",
        [
            GOOD_STEP,
            [*GOOD_STEP[:2], "wait_for_save", "get_finished", "clear_connector_metadata"],
            ["clear_connector_metadata"],  # a step that failed before binding
            ["bind_connector_metadata", "clear_connector_metadata"],
            ["register_kv_caches", *GOOD_STEP, "aclose", "aclose"],
        ],
    )
    def test_good_sequences_have_no_violation(self, methods: list[str]) -> None:
        """Complete or early-failed steps that clear exactly once are accepted."""
        assert check_lifecycle([_w(m) for m in methods]) == []

    def test_interleaved_ranks_and_steps_are_checked_separately(self) -> None:
        """Two ranks' calls interleaved, over two steps, are fine; scheduler calls ignored."""
        calls = []
        for step_id in (1, 2):
            for m in GOOD_STEP:
                calls += [_w(m, step_id, rank=0), _w(m, step_id, rank=1)]
            calls.append(ConnectorCall(role="scheduler", rank=0, step_id=step_id, method="x"))
        assert check_lifecycle(calls) == []

    @pytest.mark.parametrize(
        ("calls", "expected"),
        [
            ([_w(m) for m in GOOD_STEP[:-1]], ["rank 0 step 1: never cleared"]),
            (
                [_w(m) for m in GOOD_STEP[:-1]] + [_w(m, 2) for m in GOOD_STEP],
                ["rank 0 step 1: never cleared (bind_connector_metadata in step 2)"],
            ),
            (
                [*(_w(m) for m in GOOD_STEP), _w("clear_connector_metadata")],
                ["rank 0 step 1: cleared twice"],
            ),
            (
                [*(_w(m) for m in GOOD_STEP), _w("save_kv_layer", layer=0)],
                ["rank 0 step 1: save_kv_layer after clear_connector_metadata"],
            ),
            (
                [*(_w(m) for m in GOOD_STEP), _w("bind_connector_metadata")],
                ["rank 0 step 1: bind_connector_metadata after the step's clear"],
            ),
            (
                [_w(m) for m in (*GOOD_STEP[:1], *GOOD_STEP[4:6], GOOD_STEP[-1])],
                ["rank 0 step 1: wait_for_save after bind_connector_metadata"],
            ),
            (
                [_w("start_load_kv"), _w("clear_connector_metadata")],
                ["rank 0 step 1: start_load_kv after (none)"],
            ),
            (
                [_w("bind_connector_metadata", meta_step_id=0), _w("clear_connector_metadata")],
                ["rank 0 step 1: bound stale metadata of step 0"],
            ),
            ([_w("aclose"), _w("bind_connector_metadata")], ["after aclose"]),
            (
                [_w("clear_connector_metadata", None), _w("clear_connector_metadata", None)],
                ["rank 0 step None: cleared twice"],
            ),
            ([*(_w(m) for m in GOOD_STEP), _w("register_kv_caches")], ["register_kv_caches"]),
        ],
    )
    def test_bad_sequences_are_reported(
        self, calls: list[ConnectorCall], expected: list[str]
    ) -> None:
        """Each violation is reported once, naming rank, step and the calls involved."""
        problems = check_lifecycle(calls)
        assert len(problems) == len(expected), problems
        for problem, fragment in zip(problems, expected, strict=True):
            assert fragment in problem

    def test_only_the_bad_rank_is_reported(self) -> None:
        """A rank that never clears is named; the other rank's clean step is not."""
        calls = [_w(m, rank=0) for m in GOOD_STEP] + [_w(m, rank=1) for m in GOOD_STEP[:3]]
        assert check_lifecycle(calls) == [
            "rank 1 step 1: never cleared (after wait_for_layer_load)"
        ]
