"""Async scheduling (``EngineConfig.async_scheduling``): step N+1 is planned while step N
runs, and nothing a request sees changes.

- The same requests give the same outputs (tokens, finish reasons, logprobs) with it on
  and off: greedy and seeded sampling, penalties, chunked prefill, stop tokens, with and
  without a connector. Under block pressure the two may run other batches; greedy
  outputs are still the same there.
- The next step is really planned before the previous one is applied, and no worker
  ever sees a placeholder token; every rank runs every step once, in order.
- A step that fails (a real exception before its forward pass) fails its own requests
  only. A request admitted into the step planned after it, on prefix-cache blocks the
  failed step never wrote, is preempted and recomputed: its tokens equal a fault-free
  run's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import anyio
import attrs
import pytest

from pipeline import (
    LLM,
    AsyncEngine,
    EngineConfig,
    LoadStarted,
    MetadataBound,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    StepGraph,
)
from pipeline.artifacts import PLACEHOLDER_TOKEN
from pipeline.kernel.context import StepContext

pytestmark = pytest.mark.timeout(240)


def _config(path: Path, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = dict(
        model=str(path), dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8
    )
    values.update(overrides)
    return EngineConfig(**values)


def _summary(out: RequestOutput) -> tuple[Any, ...]:
    logprobs = None
    if out.logprobs is not None:
        logprobs = [(e.token_id, round(e.logprob, 4)) for e in out.logprobs]
    return (out.token_ids, out.finish_reason, out.stop_reason, logprobs)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    shared = [7, 3, 9, 1, 4, 4, 2, 8] * 4  # two full blocks every prompt below shares
    prompts = [shared + [i, 5, 6] * (i + 1) for i in range(8)] + [[11, 12, 13], [14]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=3),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    return prompts, params


def _run(config: EngineConfig, *, stop_token: int | None = None) -> list[tuple[Any, ...]]:
    prompts, params = _workload()
    if stop_token is not None:
        params = [attrs.evolve(p, stop_token_ids={stop_token}) for p in params]
    llm = LLM(config)
    try:
        return [_summary(out) for out in llm.generate(prompts, params)]
    finally:
        llm.close()


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "no_prefix_caching": {"enable_prefix_caching": False, "max_num_seqs": 3},
    "offload_connector": {"connector": "offload", "connector_options": {"num_blocks": 64}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_with_and_without(llama_path: Path, case: str) -> None:
    """Every request's tokens, finish reason, stop reason and logprobs are the same with
    async scheduling on and off: the steps run the same batches."""
    config = _config(llama_path, **CASES[case])
    off = _run(attrs.evolve(config, async_scheduling=False))
    on = _run(attrs.evolve(config, async_scheduling=True))
    assert on == off
    assert {summary[1] for summary in off} >= {"length"}


def test_greedy_outputs_equal_under_preemption(llama_path: Path) -> None:
    """With too few blocks for every request, greedy outputs are the same on and off.

    Here the batches may differ: a step planned ahead sees the blocks of the requests
    its predecessor ends still held, so it may preempt or admit a request one step
    apart from the engine without async scheduling. The engine's logits are not
    batch-invariant in their last bits, so a request sampled at a temperature may then
    draw other tokens (with its seed, each mode is reproducible); greedy tokens of this
    workload are the same."""
    config = _config(llama_path, num_gpu_blocks=12, max_num_batched_tokens=64)
    off = _run(attrs.evolve(config, async_scheduling=False))
    on = _run(attrs.evolve(config, async_scheduling=True))
    _, params = _workload()
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [on[i] for i in greedy] == [off[i] for i in greedy]
    assert _run(attrs.evolve(config, async_scheduling=True)) == on


def test_stop_tokens_end_requests_alike(llama_path: Path) -> None:
    """A stop token sampled in step N ends the request although step N+1 was planned
    with it: the same outputs as without async scheduling (the planned-ahead token is
    dropped)."""
    config = _config(llama_path)
    free = _run(attrs.evolve(config, async_scheduling=False))
    stop_token = free[0][0][3]  # the 4th token of the first greedy request
    off = _run(attrs.evolve(config, async_scheduling=False), stop_token=stop_token)
    on = _run(attrs.evolve(config, async_scheduling=True), stop_token=stop_token)
    assert on == off
    assert off[0][1] == "stop" and off[0][2] == stop_token


@attrs.frozen
class _WorkerBatches:
    """Records each step's batch on each rank; fails if a worker ever sees a placeholder."""

    name: ClassVar[str] = "record_batch"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput,)
    provides: ClassVar[None] = None

    seen: list[tuple[int, int, tuple[tuple[str, tuple[int, ...]], ...]]]

    async def run(self, ctx: StepContext) -> None:
        output = ctx.get(SchedulerOutput)
        batch = tuple((r.req_id, r.token_ids) for r in output.requests)
        assert all(PLACEHOLDER_TOKEN not in tokens for _, tokens in batch), batch
        self.seen.append((ctx.rank or 0, output.step_id, batch))


def _with_recorder(graph: StepGraph, recorder: _WorkerBatches) -> StepGraph:
    return graph.insert_after("bind", recorder)


def _record_scheduler(engine: AsyncEngine, calls: list[tuple[str, int]]) -> None:
    scheduler = engine.core.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def recording_schedule(**kwargs: Any) -> SchedulerOutput:
        output = schedule(**kwargs)
        calls.append(("schedule", output.step_id))
        return output

    def recording_update(output: SchedulerOutput, merged: Any) -> Any:
        calls.append(("update", output.step_id))
        return update(output, merged)

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    scheduler.update_from_output = recording_update  # type: ignore[method-assign]


async def _generate_all(engine: AsyncEngine, count: int) -> list[RequestOutput]:
    finals: list[RequestOutput] = []

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        async for out in engine.generate([1, 2, 3, i + 4] * (i + 1), params):
            if out.finished:
                finals.append(out)

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
    return finals


@pytest.mark.anyio
@pytest.mark.parametrize("world_size", [1, 2])
async def test_next_step_is_planned_before_the_previous_is_applied(
    llama_path: Path, world_size: int
) -> None:
    """With it on, step N+1 is planned before step N's output is applied, every step is
    applied once in order, and every rank runs every step once, in order, with real
    tokens. With it off, plan and apply alternate."""
    for ahead in (True, False):
        seen: list[tuple[int, int, tuple[tuple[str, tuple[int, ...]], ...]]] = []
        calls: list[tuple[str, int]] = []
        recorder = _WorkerBatches(seen)
        config = _config(llama_path, world_size=world_size, async_scheduling=ahead)
        graph = partial(_with_recorder, recorder=recorder)
        async with AsyncEngine(config, worker_graph=graph) as engine:
            _record_scheduler(engine, calls)
            finals = await _generate_all(engine, 4)
            assert len(finals) == 4 and all(f.finish_reason == "length" for f in finals)
        applied = [step for kind, step in calls if kind == "update"]
        assert applied == sorted(applied) == list(range(applied[0], applied[0] + len(applied)))
        planned_ahead = [
            step
            for i, (kind, step) in enumerate(calls)
            if kind == "schedule" and ("update", step - 1) in calls[i + 1 :]
        ]
        assert bool(planned_ahead) is ahead, calls
        for rank in range(world_size):
            steps = [step for r, step, _ in seen if r == rank]
            assert steps == sorted(set(steps))
        assert len(seen) == world_size * len({step for _, step, _ in seen})


@attrs.frozen
class _FailWhenFirstScheduled:
    """The worker's ``load`` stage, raising instead (after 0.1 s) in the step that first
    schedules ``req_id``: ``forward`` needs ``load``'s artifact, so that step writes no
    KV."""

    name: ClassVar[str] = "load"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, MetadataBound)
    provides: ClassVar[type] = LoadStarted

    load: Any
    req_id: str
    fired: list[int]

    async def run(self, ctx: StepContext) -> LoadStarted:
        output = ctx.get(SchedulerOutput)
        if not self.fired and any(r.req_id == self.req_id and r.new for r in output.requests):
            self.fired.append(output.step_id)
            await anyio.sleep(0.1)  # as a slow load would: the next step is planned now
            raise RuntimeError(f"injected failure in step {output.step_id}")
        started: LoadStarted = await self.load.run(ctx)
        return started


SHARED = [5, 9, 2, 7, 1, 8, 3, 6, 4, 10, 12, 14, 16, 18, 20, 22] * 2  # two full blocks


@pytest.mark.anyio
@pytest.mark.parametrize("ahead", [True, False])
async def test_a_failed_step_fails_only_its_own_requests(
    llama_path: Path, ahead: bool, leak_check: Callable[[dict[str, int]], None]
) -> None:
    """Step k (the first with request ``victim``) raises before its forward pass (in
    ``load``, which ``forward`` needs).

    ``victim`` fails with ``"error"``; ``late`` shares ``victim``'s first block and is
    added just after step k is planned: with async scheduling step k+1 is planned
    while step k runs, so ``late`` takes the block that step k registered and never
    wrote. It must be preempted and recomputed: its tokens and their logprobs (which
    KV that was never written would change) equal those of a run without the fault.
    ``early``, running before step k, is unaffected, or failed with step k."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    late_prompt = [*SHARED[:16], 30, 31, 32, 33, 34]

    config = _config(llama_path, async_scheduling=ahead)
    async with AsyncEngine(config) as reference:
        expected_late = [o async for o in reference.generate(late_prompt, params)][-1]
        expected_early = [o async for o in reference.generate([1, 2, 3], params)][-1]

    fired: list[int] = []

    def graph(g: StepGraph) -> StepGraph:
        return g.replace("load", _FailWhenFirstScheduled(g["load"], "victim", fired))

    async with AsyncEngine(config, worker_graph=graph) as engine:
        scheduler = engine.core.scheduler
        schedule = scheduler.schedule
        streams: dict[str, Any] = {}

        def add_late_after_victim(**kwargs: Any) -> SchedulerOutput:
            output = schedule(**kwargs)
            victim = any(r.req_id == "victim" for r in output.requests)
            if victim and "late" not in streams:  # step k is planned; k+1 admits late
                streams["late"] = engine.generate(late_prompt, params, request_id="late")
            return output

        scheduler.schedule = add_late_after_victim  # type: ignore[method-assign]
        streams["early"] = engine.generate([1, 2, 3], params, request_id="early")
        await anyio.sleep(0)
        streams["victim"] = engine.generate(SHARED, params, request_id="victim")
        finals: dict[str, RequestOutput] = {}

        async def drain(name: str) -> None:
            while name not in streams:
                await anyio.sleep(0.001)
            async for out in streams[name]:
                finals[name] = out

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for name in ("early", "victim", "late"):
                    tg.start_soon(drain, name)
        assert fired, "the fault never fired"
        assert finals["victim"].finish_reason == "error"
        assert f"step {fired[0]}" in (finals["victim"].error or "")
        assert finals["late"].token_ids == expected_late.token_ids
        assert finals["late"].logprobs is not None and expected_late.logprobs is not None
        got = [e.logprob for e in finals["late"].logprobs]
        assert got == pytest.approx([e.logprob for e in expected_late.logprobs], abs=1e-5)
        assert finals["late"].finish_reason == "length"
        if finals["early"].finish_reason == "length":
            assert finals["early"].token_ids == expected_early.token_ids
        else:  # it was in step k as well: it failed with it, alone with victim
            assert finals["early"].finish_reason == "error"
        leak_check(engine.leak_report())
