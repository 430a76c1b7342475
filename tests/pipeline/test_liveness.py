"""Liveness: the engine keeps stepping while transfers are pending and stops once drained;
a rank that never reports a transfer turns into an explicit expiry, never a stuck request."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio
import attrs
import pytest
import structlog

from connectors.base import (
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
    RequestFinishedResult,
    WorkerFinished,
)
from connectors.registry import register_connector, unregister_connector
from pipeline import AsyncEngine, EngineConfig, SamplingParams, StepContext
from pipeline.artifacts import EngineStepOutput, FanInOutput, SchedulerOutput
from pipeline.request import Request, RequestOutput

pytestmark = pytest.mark.anyio

NAME = "liveness-test"


@attrs.frozen
class TransferMeta(KVConnectorMetadata):
    """The step, and the requests whose async load starts in it."""

    step_id: int
    loads: tuple[str, ...] = ()


@attrs.frozen
class Report:
    rank: int
    step_id: int
    kind: str
    req_id: str


class TransferScheduler(KVConnectorScheduler):
    """Delays frees (``delay_free``), loads ``async_loads[req_id]`` tokens asynchronously,
    and has pending work until every transfer finished or expired."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.options = context.options
        self.sending: set[str] = set()
        self.loading: set[str] = set()
        self._new_loads: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        tokens = self.options.get("async_loads", {}).get(request.request_id, 0)
        if request.request_id in self.loading or num_computed_tokens >= tokens:
            return MatchResult(0)
        return MatchResult(tokens - num_computed_tokens, load_async=True)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self.loading.add(request.request_id)
            self._new_loads.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferMeta:
        loads, self._new_loads = tuple(self._new_loads), []
        return TransferMeta(scheduler_output.step_id, loads)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        self.loading.discard(request.request_id)
        if self.options.get("delay_free", False):
            self.sending.add(request.request_id)
            return RequestFinishedResult(delay_free=True)
        return RequestFinishedResult()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.sending -= output.finished_sending | output.expired_sending
        self.loading -= output.finished_recving | output.expired_recving

    def has_pending_work(self) -> bool:
        return bool(self.sending or self.loading)


class TransferWorker(KVConnectorWorker):
    """Rank ``r`` reports a send ``send_delays[r]`` steps after it learns the request
    finished, a load ``recv_delays[r]`` steps after it started; ``None``: never."""

    reports: ClassVar[list[Report]] = []

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        rank = context.rank
        self.send_delay: int | None = context.options.get("send_delays", [None] * 8)[rank]
        self.recv_delay: int | None = context.options.get("recv_delays", [None] * 8)[rank]
        self.sends: dict[str, int] = {}  # req_id -> step it finished
        self.loads: dict[str, int] = {}  # req_id -> step its load started

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, TransferMeta)
        for req_id in meta.loads:
            self.loads[req_id] = meta.step_id

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        meta = self.connector_metadata
        assert isinstance(meta, TransferMeta)
        step = meta.step_id
        for req_id in finished_req_ids:
            self.sends.setdefault(req_id, step)
        sending = self._due(self.sends, self.send_delay, step, "sending")
        recving = self._due(self.loads, self.recv_delay, step, "recving")
        return WorkerFinished(sending=sending, recving=recving)

    def _due(
        self, table: dict[str, int], delay: int | None, step: int, kind: str
    ) -> frozenset[str]:
        if delay is None:
            return frozenset()
        due = frozenset(r for r, start in table.items() if step >= start + delay)
        for req_id in due:
            del table[req_id]
            TransferWorker.reports.append(Report(self.context.rank, step, kind, req_id))
        return due


@attrs.frozen
class Seen:
    step_id: int
    num_requests: int
    finished_sending: frozenset[str]
    expired_sending: frozenset[str]
    pending_transfers: int
    blocks_in_use: int


@attrs.frozen
class ProbeStage:
    """After ``update``: what the scheduler holds at the end of each engine step."""

    name: ClassVar[str] = "probe"
    requires: ClassVar[tuple[type, ...]] = (EngineStepOutput, FanInOutput)
    provides: ClassVar[type] = Seen

    scheduler: Any
    seen: list[Seen]

    async def run(self, ctx: StepContext) -> Seen:
        out, merged = ctx.get(EngineStepOutput), ctx.get(FanInOutput)
        leaks = self.scheduler.leak_report()
        seen = Seen(
            out.step_id,
            out.num_requests,
            merged.finished_sending,
            merged.expired_sending,
            leaks["pending_transfers"],
            leaks["blocks_in_use"],
        )
        self.seen.append(seen)
        return seen


@pytest.fixture(autouse=True)
def transfer_connector() -> Iterator[None]:
    register_connector(NAME, TransferScheduler, TransferWorker, replace=True)
    TransferWorker.reports.clear()
    yield
    TransferWorker.reports.clear()
    unregister_connector(NAME)


def engine(path: Path, seen: list[Seen], **options: Any) -> AsyncEngine:
    lease = options.pop("lease", 60.0)
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        max_model_len=512,
        world_size=3,
        connector=NAME,
        connector_options=options,
        transfer_lease_s=lease,
    )
    return AsyncEngine(
        config,
        engine_graph=lambda g: g.insert_after("update", ProbeStage(g["update"].scheduler, seen)),
    )


async def consume(engine: AsyncEngine, prompt: list[int], params: SamplingParams, **kw: Any):
    last: RequestOutput | None = None
    async for out in engine.generate(prompt, params, **kw):
        last = out
    assert last is not None
    return last


async def drained(engine: AsyncEngine) -> None:
    """Wait (bounded) until the step loop is at rest: no step needed and none running
    (with async scheduling the core may need nothing while its last step still runs)."""
    with anyio.fail_after(20):
        while not engine.is_idle:
            await anyio.sleep(0.01)


PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class TestDelayedFree:
    async def test_blocks_freed_only_once_every_rank_reported(self, llama_path: Path, leak_check):
        """Ranks report the send 1, 3 and 5 steps late: blocks are held until the last
        report, the engine runs no-forward steps until then, and then stops."""
        seen: list[Seen] = []
        async with engine(llama_path, seen, delay_free=True, send_delays=[1, 3, 5]) as eng:
            out = await consume(eng, list(range(1, 21)), PARAMS, request_id="a")
            assert out.finish_reason == "length"
            await drained(eng)
            steps_then = eng.num_steps
            await anyio.sleep(0.1)
            assert eng.num_steps == steps_then  # drained: the loop stopped stepping
            leak_check(eng.leak_report())
            assert not eng.core.connector.has_pending_work()
        reported = {r.rank: r.step_id for r in TransferWorker.reports if r.kind == "sending"}
        assert sorted(reported) == [0, 1, 2]
        finished_step = min(reported.values()) - 1
        last = max(reported.values())
        assert reported[2] - reported[0] == 4  # the ranks reported in different steps
        by_step = {s.step_id: s for s in seen}
        for step in range(finished_step, last):
            assert by_step[step].pending_transfers == 1 and by_step[step].blocks_in_use > 0
            assert by_step[step].finished_sending == set()
        for step in range(finished_step + 1, last + 1):
            assert by_step[step].num_requests == 0  # no-forward steps kept the engine going
        assert by_step[last].finished_sending == {"a"}
        assert by_step[last].pending_transfers == 0 and by_step[last].blocks_in_use == 0
        assert max(by_step) == last  # and nothing ran after the drain

    async def test_a_silent_rank_expires_the_send(self, llama_path: Path, leak_check):
        """Rank 1 never reports: after the lease the blocks are freed with a warning
        naming rank 1, the connector is told, and the engine drains."""
        seen: list[Seen] = []
        with structlog.testing.capture_logs() as logs:
            async with engine(
                llama_path, seen, lease=0.3, delay_free=True, send_delays=[1, None, 2]
            ) as eng:
                out = await consume(eng, list(range(1, 21)), PARAMS, request_id="a")
                assert out.finish_reason == "length"
                await drained(eng)
                leak_check(eng.leak_report())
                assert not eng.core.connector.has_pending_work()
                assert eng.core.scheduler._state.num_expired_sending == 1
        (expiry,) = [s for s in seen if s.expired_sending]
        assert expiry.expired_sending == {"a"} and expiry.blocks_in_use == 0
        assert all(s.finished_sending == set() for s in seen)
        lease = [e for e in logs if e["event"] == "fan-in lease expired"]
        assert [(e["req_id"], e["missing_ranks"], e["log_level"]) for e in lease] == [
            ("a", [1], "warning")
        ]
        assert any(e["event"] == "KV send expired; blocks freed" for e in logs)


class TestAsyncLoad:
    async def test_a_load_never_reported_by_one_rank_fails_that_request_alone(
        self, llama_path: Path, leak_check
    ):
        """Rank 2 never reports the async load of "slow": after the lease it fails with
        "error" naming rank 2; the other requests finish normally."""
        seen: list[Seen] = []
        async with engine(
            llama_path, seen, lease=0.3, async_loads={"slow": 16}, recv_delays=[1, 2, None]
        ) as eng:
            results: dict[str, RequestOutput] = {}

            async def run(req_id: str, prompt: list[int]) -> None:
                results[req_id] = await consume(eng, prompt, PARAMS, request_id=req_id)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "slow", list(range(1, 41)))
                tg.start_soon(run, "ok1", list(range(50, 70)))
                tg.start_soon(run, "ok2", list(range(80, 85)))
            await drained(eng)
            leak_check(eng.leak_report())
            assert not eng.core.connector.has_pending_work()
        slow = results["slow"]
        assert slow.finish_reason == "error" and slow.token_ids == ()
        assert "rank(s) 2" in (slow.error or "") and "'slow'" in (slow.error or "")
        for req_id in ("ok1", "ok2"):
            assert results[req_id].finish_reason == "length"
            assert len(results[req_id].token_ids) == PARAMS.max_tokens
        loads = {(r.rank, r.req_id) for r in TransferWorker.reports if r.kind == "recving"}
        assert loads == {(0, "slow"), (1, "slow")}
