"""The engine under random faults: the step's promises hold on every step of every rank.

A hypothesis test drives ``AsyncEngine`` (1-4 virtual ranks, ``connector="faulty"``
around ``"recording"``, a 0.5 s fan-in deadline) through random requests, aborts (client
gone mid-stream, ``engine.abort``) and faults (raise / hang / cancel / corrupt at any
connector call or worker stage, any rank, any step). After the run: every rank cleared
exactly once per step and nothing followed the clear, no metadata is bound, nothing
leaked, and every request ended exactly once, with the fault-free engine's tokens or a
typed error. Below, one example each of faults that once stopped the engine (a raising
scheduler-side connector call, a native cancel in the engine graph): they fail at most
their own requests now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from fault_schedule import (
    WORKER_CALLS,
    Client,
    Seen,
    check_clears,
    check_request,
    holds_at_most,
    until_idle,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.testing import (
    CALLS,
    Fault,
    FaultStage,
    FaultyConnector,
    RecordingConnector,
    check_lifecycle,
)
from pipeline import (
    AsyncEngine,
    EngineConfig,
    LoadStarted,
    MetadataBound,
    ModelOutput,
    RequestOutput,
    SampledTokens,
    SamplingParams,
    SaveResult,
    SchedulerOutput,
    StepGraph,
    WorkerOutput,
)

STAGE_ARTIFACTS: dict[str, type] = {
    "bind": MetadataBound,
    "load": LoadStarted,
    "forward": ModelOutput,
    "sample": SampledTokens,
    "save": SaveResult,
    "finished": WorkerOutput,
}
# Scheduler-side faults: a raising call fails at most the requests it was about.
SCHEDULER_FAULTS = (
    ("get_num_new_matched_tokens", "corrupt"),
    ("get_num_new_matched_tokens", "raise"),
    ("update_state_after_alloc", "raise"),
    ("build_connector_meta", "corrupt"),
    ("build_connector_meta", "raise"),
    ("has_pending_work", "corrupt"),
    ("has_pending_work", "raise"),
    ("request_finished", "raise"),
    ("update_connector_output", "raise"),
)
LAST_FAULT_STEP = 8
SAVE_SIDE_CALLS = ("save_kv_layer", "wait_for_save", "get_finished")


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    RecordingConnector.reset()
    FaultyConnector.reset()
    yield
    RecordingConnector.reset()
    FaultyConnector.reset()


# -- the random schedule ---------------------------------------------------------------


LAST = Client(prompt=(7, 8, 9), max_tokens=2, arrive_after=0, abort=None, abort_after=0)
"""The request sent after the random ones: the engine still serves."""


@attrs.frozen
class Scenario:
    world_size: int
    clients: tuple[Client, ...]
    faults: tuple[Fault, ...]
    stages: tuple[tuple[str, FaultStage], ...]  # (stage to insert after, fault stage)
    engine_stage: FaultStage | None
    load_failure_policy: str


clients = st.builds(
    Client,
    prompt=st.lists(st.integers(1, 255), min_size=1, max_size=40).map(tuple),
    max_tokens=st.integers(1, 6),
    arrive_after=st.integers(0, 4),
    abort=st.sampled_from([None, None, "client", "engine"]),
    abort_after=st.integers(0, 3),
)
steps = st.integers(0, LAST_FAULT_STEP)


@st.composite
def connector_faults(draw: st.DrawFn, world_size: int) -> Fault:
    if draw(st.integers(0, 4)) == 0:
        call, action = draw(st.sampled_from(SCHEDULER_FAULTS))
        return Fault(call=call, action=action, step=draw(st.one_of(st.none(), steps)))
    call = draw(st.sampled_from(WORKER_CALLS))
    action = draw(st.sampled_from(CALLS[call]))
    layer_hook = call in ("wait_for_layer_load", "save_kv_layer")
    long_hang = 0.7 if layer_hook else 5.0  # either way past the 0.5 s fan-in deadline
    return Fault(
        call=call,
        action=action,  # type: ignore[arg-type]
        step=draw(steps),
        rank=draw(st.one_of(st.none(), st.integers(0, world_size - 1))),
        layer=draw(st.sampled_from([None, 0, 1])) if layer_hook else None,
        times=draw(st.integers(1, 2)),
        hang_s=draw(st.sampled_from([0.02, long_hang])),
    )


@st.composite
def stage_faults(draw: st.DrawFn, world_size: int, index: int) -> tuple[str, FaultStage]:
    after = draw(st.sampled_from(sorted(STAGE_ARTIFACTS)))
    return after, FaultStage(
        action=draw(st.sampled_from(["raise", "hang", "cancel"])),
        name=f"fault{index}",
        requires=(STAGE_ARTIFACTS[after],),
        step=draw(steps),
        rank=draw(st.one_of(st.none(), st.integers(0, world_size - 1))),
        hang_s=draw(st.sampled_from([0.02, 5.0])),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    world_size = draw(st.integers(1, 4))
    num_stages = draw(st.integers(0, 2))
    engine_stage = draw(
        st.one_of(
            st.none(),
            st.builds(
                FaultStage,
                action=st.sampled_from(["raise", "hang"]),
                name=st.just("engine_fault"),
                requires=st.just((SchedulerOutput,)),
                step=steps,
                hang_s=st.just(0.02),
            ),
        )
    )
    return Scenario(
        world_size=world_size,
        clients=tuple(draw(st.lists(clients, min_size=1, max_size=5))),
        faults=tuple(draw(st.lists(connector_faults(world_size), max_size=3))),
        stages=tuple(draw(stage_faults(world_size, i)) for i in range(num_stages)),
        engine_stage=engine_stage,
        load_failure_policy=draw(st.sampled_from(["recompute", "fail"])),
    )


# -- running it ------------------------------------------------------------------------


def _params(client: Client) -> SamplingParams:
    return SamplingParams(max_tokens=client.max_tokens, temperature=0.0)


def _config(path: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=48,  # longer prompts are prefilled in chunks
        enable_prefix_caching=True,
        **kw,
    )


_REFERENCE: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}


def _references(path: Path, clients: tuple[Client, ...]) -> dict[Client, tuple[int, ...]]:
    """What a fault-free engine generates (greedy) for each client; cached per request."""
    missing = sorted({(c.prompt, c.max_tokens) for c in clients} - set(_REFERENCE))

    async def run() -> None:
        async def one(engine: AsyncEngine, prompt: tuple[int, ...], max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            outs = [o async for o in engine.generate(list(prompt), params)]
            _REFERENCE[prompt, max_tokens] = outs[-1].token_ids

        async with AsyncEngine(_config(path)) as engine, anyio.create_task_group() as tg:
            for prompt, max_tokens in missing:
                tg.start_soon(one, engine, prompt, max_tokens)

    if missing:
        anyio.run(run)
    return {c: _REFERENCE[c.prompt, c.max_tokens] for c in clients}


async def _drive(engine: AsyncEngine, client: Client, seen: Seen) -> None:
    start = engine.num_steps
    with anyio.move_on_after(0.05 * client.arrive_after):
        while engine.num_steps < start + client.arrive_after:
            await anyio.sleep(0.002)
    stream = engine.generate(list(client.prompt), _params(client))
    seen.request_id = stream.request_id
    if client.abort == "client" and client.abort_after == 0:
        seen.aborted = True
        await stream.aclose()
        return
    async for out in stream:
        seen.outputs.append(out)
        if out.finished or len(seen.outputs) < client.abort_after:
            continue
        if client.abort == "engine" and not seen.aborted:
            seen.aborted = True
            engine.abort(stream.request_id)
        elif client.abort == "client":
            seen.aborted = True
            with anyio.move_on_after(0.001):  # the client leaves while awaiting the next
                seen.outputs.append(await stream.__anext__())
            await stream.aclose()
            return


def _worker_graph(scenario: Scenario) -> Callable[[StepGraph], StepGraph] | None:
    if not scenario.stages:
        return None

    def build(graph: StepGraph) -> StepGraph:
        for after, stage in scenario.stages:
            graph = graph.insert_after(after, stage)
        return graph

    return build


def _failing_steps(scenario: Scenario) -> set[int]:
    """Steps in which a fault fired that must fail the step: a raise, a cancel, or a hang
    past the fan-in deadline, on a worker (connector call or stage) or the engine. A
    raise in a save-side call (save_kv_layer, wait_for_save, get_finished) costs the
    step's caching only (issue 30), so it fails nothing."""
    steps: set[int] = set()
    for f in FaultyConnector.fired:
        fault = f.fault
        if f.step is None or f.call not in WORKER_CALLS:
            continue
        if fault.action == "raise" and f.call in SAVE_SIDE_CALLS:
            continue
        if fault.action in ("raise", "cancel") or (fault.action == "hang" and fault.hang_s > 0.5):
            steps.add(f.step)
    stages = [stage for _, stage in scenario.stages]
    if scenario.engine_stage is not None:
        stages.append(scenario.engine_stage)
    for stage in stages:
        if stage.action != "hang" or stage.hang_s > 0.5:
            steps.update(step for step, _ in stage.fired)
    return steps


def _check_failed_steps(scenario: Scenario, seen: list[Seen], *, ahead: bool) -> None:
    """A step in which a failing fault fired failed its requests, with a StepFailure
    naming that step (those of its requests whose client had not left yet).

    ``ahead`` (async scheduling): the loop applies ``engine.abort`` while a step runs,
    so a request of the failed step may have ended with ``"abort"`` first."""
    scheduled = {
        c.step_id: set(c.req_ids)
        for c in RecordingConnector.scheduler_calls()
        if c.method == "build_connector_meta"
    }
    by_id = {s.request_id: s for s in seen}
    for step in _failing_steps(scenario):
        watched = [
            by_id[r]
            for r in scheduled.get(step, ())
            if r in by_id and not (by_id[r].client.abort == "client" and by_id[r].aborted)
        ]
        for s in watched:
            final = s.outputs[-1]
            if ahead and s.client.abort == "engine" and final.finish_reason == "abort":
                continue
            assert final.failure is not None and final.failure.step_id == step, (step, final)


def _expected_problems(world_size: int) -> set[str]:
    """check_lifecycle's report of the stale metadata a corrupt build handed out."""
    stale = {
        f.step
        for f in FaultyConnector.fired
        if f.call == "build_connector_meta" and f.step is not None and f.step > 0
    }
    return {
        f"rank {rank} step {step}: bound stale metadata of step {step - 1}"
        for step in stale
        for rank in range(world_size)
    }


async def _run(
    path: Path,
    scenario: Scenario,
    references: dict[Client, tuple[int, ...]],
    leak_check: Callable[[dict[str, int]], None],
) -> None:
    RecordingConnector.reset()
    FaultyConnector.reset()
    config = _config(
        path,
        world_size=scenario.world_size,
        connector="faulty",
        connector_options={"inner": "recording", "faults": [f.to_dict() for f in scenario.faults]},
        fan_in_timeout_s=0.5,
        transfer_lease_s=0.2,
        load_failure_policy=scenario.load_failure_policy,
    )
    engine_stage = scenario.engine_stage
    engine_graph = (
        None if engine_stage is None else (lambda g: g.insert_after("schedule", engine_stage))
    )
    seen = [Seen(c) for c in scenario.clients]
    last = Seen(LAST)
    async with AsyncEngine(
        config, worker_graph=_worker_graph(scenario), engine_graph=engine_graph
    ) as engine:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for s in seen:
                    tg.start_soon(_drive, engine, s.client, s)
            await until_idle(engine)
            # The engine keeps serving; the step of this last request also hands the
            # workers the ids of every request that ended before it.
            await _drive(engine, LAST, last)
            await until_idle(engine)
        leak_check(engine.leak_report())
        assert not engine.core.scheduler.requests
        for worker in engine.core.workers:
            assert worker.connector is not None and worker.connector.connector_metadata is None
            assert holds_at_most(worker.runner, last.request_id), (
                "a rank kept the state of a request that ended"
            )
        core = engine.core
    assert core.leak_report()["bound_metadata"] == 0  # also after close

    problems = set(check_lifecycle(RecordingConnector.calls))
    assert problems <= _expected_problems(scenario.world_size), sorted(problems)
    check_clears(RecordingConnector.worker_calls())

    garbage = any(f.call == "get_num_new_matched_tokens" for f in FaultyConnector.fired)
    for s in [*seen, last]:
        check_request(s, None if garbage else references[s.client])
    _check_failed_steps(scenario, [*seen, last], ahead=config.async_scheduling)


class TestEngineUnderFaults:
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
    )
    @given(scenario=scenarios())
    def test_step_promises_hold_under_random_faults(
        self, llama_path: Path, leak_check: Callable[[dict[str, int]], None], scenario: Scenario
    ) -> None:
        """Every step of every rank clears exactly once with nothing after it, nothing
        leaks, and every request ends exactly once with the fault-free tokens or a typed
        error, whatever faults, aborts and rank counts are thrown at the engine."""
        references = _references(llama_path, (*scenario.clients, LAST))
        anyio.run(_run, llama_path, scenario, references, leak_check)


# -- single faults that once stopped the engine -----------------------------------------


def _engine_run(coro: Callable[[], Any]) -> Any:
    """Run ``coro`` on asyncio; an engine that dies by cancellation fails the assertion."""
    try:
        return anyio.run(coro)
    except BaseException as exc:
        if isinstance(exc, Exception | KeyboardInterrupt):
            raise
        raise AssertionError(f"the engine died: {exc!r}") from None


async def _last(engine: AsyncEngine, prompt: list[int], max_tokens: int) -> RequestOutput:
    outs = [o async for o in engine.generate(prompt, _params_for(max_tokens))]
    return outs[-1]


def _params_for(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


class TestSingleFaults:
    def test_update_connector_output_failure_still_ends_finished_requests(
        self, llama_path: Path
    ) -> None:
        """A request that finished in a step whose update_connector_output raised still
        gets its final output."""

        async def run() -> RequestOutput:
            fault = Fault(call="update_connector_output", action="raise", step=1)
            config = _config(
                llama_path,
                connector="faulty",
                connector_options={"inner": "recording", "faults": [fault.to_dict()]},
            )
            async with AsyncEngine(config) as engine:
                with anyio.fail_after(3):
                    return await _last(engine, [1, 2, 3], 2)

        out = _engine_run(run)
        assert out.finished and out.finish_reason in ("length", "error")

    @pytest.mark.parametrize(
        "call",
        [
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "has_pending_work",
        ],
    )
    def test_scheduler_connector_failure_keeps_the_engine_serving(
        self, llama_path: Path, call: str
    ) -> None:
        """A scheduler-side connector call that raises fails at most its requests; the
        next request is served."""

        async def run() -> tuple[RequestOutput, RequestOutput]:
            step = None if call == "has_pending_work" else 0  # it runs between steps
            fault = Fault(call=call, action="raise", step=step)
            config = _config(
                llama_path,
                connector="faulty",
                connector_options={"inner": "recording", "faults": [fault.to_dict()]},
            )
            async with AsyncEngine(config) as engine:
                with anyio.fail_after(3):
                    return await _last(engine, [1, 2, 3], 2), await _last(engine, [4, 5], 2)

        first, second = _engine_run(run)
        assert first.finish_reason in ("length", "error")
        assert second.finish_reason == "length"

    def test_native_cancel_in_the_engine_graph_fails_the_step(self, llama_path: Path) -> None:
        """A stage of the engine graph whose task is cancelled natively fails its step."""

        async def run() -> tuple[RequestOutput, RequestOutput]:
            fault = FaultStage(action="cancel", requires=(SchedulerOutput,), step=1)
            async with AsyncEngine(
                _config(llama_path), engine_graph=lambda g: g.insert_after("schedule", fault)
            ) as engine:
                with anyio.fail_after(3):
                    return await _last(engine, [1, 2, 3], 3), await _last(engine, [4, 5], 2)

        failed, served = _engine_run(run)
        assert failed.finish_reason == "error"
        assert failed.failure is not None and failed.failure.cancelled
        assert served.finish_reason == "length"
