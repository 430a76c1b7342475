"""``EngineConfig.inline_forward`` (every forward pass and its sampling on the event
loop's thread) and ``inline_forward_below_s`` (a pass there when recent passes of its
step's shape were shorter than that): nothing a request sees changes.

- The same requests give the same outputs (tokens, finish and stop reasons, logprobs)
  with the runner's compute thread, inline, and adaptive (inline from the second pass
  of a shape on): greedy and seeded sampling, penalties, chunked prefill, without
  prefix caching, with the offload connector (whose layer hooks then run on the loop's
  thread), and with async scheduling on.
- Inline, the forward runs on the thread of the loop that awaits it and no compute
  thread exists; handed over (a zero bound), it runs there; adaptive, the first pass of
  each step shape runs there and the later ones on the loop's thread; with two ranks
  every pass is handed over (a rank's pass waits for the other's).
- A forward pass that raises (a real exception, inline on the loop) fails its own
  step's requests only: the engine goes on serving.
- A bad value, or inline with an executor whose ranks run in workers of their own, is
  refused with a typed error naming the field.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.config import INLINE_FORWARD_BELOW_S
from pipeline.errors import InvalidConfigError
from stages.model.compute_thread import ComputeThread, InlineCompute
from stages.model.runner import ModelRunner
from tests.pipeline.test_async_scheduling import CASES, _config, _run

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_to_compute_thread(llama_path: Path, case: str) -> None:
    """Every request's outputs are the same whichever thread runs the forward pass."""
    config = _config(llama_path, **CASES[case])
    threaded = _run(attrs.evolve(config, inline_forward=False, inline_forward_below_s=0.0))
    inline = _run(attrs.evolve(config, inline_forward=True))
    adaptive = _run(attrs.evolve(config, inline_forward_below_s=1.0))
    assert inline == threaded
    assert adaptive == threaded
    assert {summary[1] for summary in threaded} >= {"length"}


def test_outputs_equal_with_async_scheduling(llama_path: Path) -> None:
    """Inline and async scheduling together: the same outputs as neither (the planned
    step then waits for the loop, which the forward pass holds)."""
    config = _config(llama_path)
    plain = _run(config)
    both = _run(attrs.evolve(config, inline_forward=True, async_scheduling=True))
    assert both == plain


def _record_threads(monkeypatch: pytest.MonkeyPatch, hooked: list[bool] | None = None) -> list[int]:
    """Wrap ``ModelRunner.execute``: the ident of each thread that runs a forward pass
    (and in ``hooked`` whether the pass was given the connector, whose hooks it runs)."""
    threads: list[int] = []
    execute = ModelRunner.execute

    def recording(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        if hooked is not None:
            hooked.append(len(args) > 1 and args[1] is not None)
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return threads


async def _generate(engine: AsyncEngine, prompt: list[int], max_tokens: int = 4) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last


MODES: dict[str, dict[str, Any]] = {
    "inline": {"inline_forward": True},
    "handed_over": {"inline_forward_below_s": 0.0},
    "adaptive": {"inline_forward_below_s": 1.0},
    "adaptive_two_ranks": {"inline_forward_below_s": 1.0, "world_size": 2},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_forward_thread(llama_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Where each forward pass of one request (a prefill, then 3 decode steps) runs."""
    threads = _record_threads(monkeypatch)

    async def main() -> tuple[int, set[str], Any]:
        loop_thread = threading.get_ident()
        async with AsyncEngine(_config(llama_path, **MODES[mode])) as engine:
            out = await _generate(engine, [5, 6, 7])
            assert out is not None and len(out.token_ids) == 4
            names = {t.name for t in threading.enumerate()}
            compute = engine.core.workers[0].runner.compute
        return loop_thread, names, compute

    loop_thread, names, compute = anyio.run(main)
    on_loop = [t == loop_thread for t in threads]
    compute_threads = {n for n in names if n.startswith("kvstep-compute")}
    if mode == "inline":
        assert on_loop == [True] * 4
        assert not compute_threads
        assert type(compute) is InlineCompute
        return
    assert compute_threads and type(compute) is ComputeThread
    if mode == "adaptive":  # the prefill's shape and the decode's: first seen, handed over
        assert on_loop == [False, False, True, True]
        assert (compute.thread_calls, compute.inline_calls) == (2, 2)
    elif mode == "handed_over":
        assert on_loop == [False] * 4 and compute.inline_calls == 0
    else:  # two ranks: both ranks' passes, all on their threads
        assert len(on_loop) == 8 and not any(on_loop) and compute.inline_calls == 0


def test_passes_longer_than_the_bound_are_always_handed_over(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default bound (2 ms), passes that take 50 ms (a real sleep inside the
    pass) never run on the loop's thread, however often their shape repeats; a ticker
    on the loop keeps running while they compute."""
    threads = _record_threads(monkeypatch)
    execute = ModelRunner.execute

    def slow(self: ModelRunner, *args: Any) -> Any:
        time.sleep(0.05)
        return execute(self, *args)

    monkeypatch.setattr(ModelRunner, "execute", slow)
    ticks: list[float] = []

    async def main() -> int:
        async with AsyncEngine(_config(llama_path)) as engine:
            assert engine.config.inline_forward_below_s == INLINE_FORWARD_BELOW_S == 0.002
            async with anyio.create_task_group() as tg:

                async def tick() -> None:
                    while True:
                        ticks.append(time.monotonic())
                        await anyio.sleep(0.005)

                tg.start_soon(tick)
                out = await _generate(engine, [5, 6, 7], max_tokens=8)
                tg.cancel_scope.cancel()
            assert out is not None and len(out.token_ids) == 8
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert len(threads) == 8 and loop_thread not in threads
    assert len(ticks) > 8 * 0.05 / 0.005 / 4  # the loop ran while the passes computed


def test_a_pass_that_runs_connector_hooks_is_handed_over(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive, with the offload connector: a pass given the connector (its layer hooks
    may wait for the loop's work; the connector binds metadata every step) runs on the
    compute thread however short its shape's passes were."""
    hooked: list[bool] = []
    threads = _record_threads(monkeypatch, hooked)
    options = {"connector": "offload", "connector_options": {"num_blocks": 64}}

    async def main() -> tuple[int, int]:
        async with AsyncEngine(
            _config(llama_path, inline_forward_below_s=1.0, **options)
        ) as engine:
            for _ in range(2):  # the second time the prompt's blocks are cached
                out = await _generate(engine, [9, 8, 7, 6] * 8, max_tokens=6)
                assert out is not None and len(out.token_ids) == 6
            inline_calls = engine.core.workers[0].runner.compute.inline_calls
        return threading.get_ident(), inline_calls

    loop_thread, inline_calls = anyio.run(main)
    assert len(threads) >= 10 and all(hooked)
    assert loop_thread not in threads and inline_calls == 0


def test_failed_forward_fails_its_step_only(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward pass that raises on the loop's thread fails that step's request with
    ``finish_reason="error"``; the next request is served in full."""
    execute = ModelRunner.execute
    calls = {"n": 0}

    def failing_once(self: ModelRunner, scheduler_output: Any, *args: Any) -> Any:
        if scheduler_output.requests:
            calls["n"] += 1
            if calls["n"] == 2:  # the first request's first decode step
                raise RuntimeError("injected forward failure")
        return execute(self, scheduler_output, *args)

    monkeypatch.setattr(ModelRunner, "execute", failing_once)

    async def main() -> tuple[Any, Any]:
        async with AsyncEngine(_config(llama_path, inline_forward=True)) as engine:
            failed = await _generate(engine, [1, 2, 3], max_tokens=6)
            served = await _generate(engine, [4, 5, 6], max_tokens=6)
        return failed, served

    failed, served = anyio.run(main)
    assert failed.finish_reason == "error"
    assert len(failed.token_ids) == 1  # the prefill's token, before the failed step
    assert served.finish_reason == "length"
    assert len(served.token_ids) == 6


@pytest.mark.parametrize("value", [True, -0.001, 1.5, float("nan"), float("inf"), "0.002", None])
def test_a_bad_bound_is_refused(value: object) -> None:
    """inline_forward_below_s: a number of seconds in [0, 1], never a bool; the engine's
    config and the runner's spec refuse the same values, naming the field."""
    from stages.model.settings import RunnerSettings

    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(inline_forward_below_s=value)  # type: ignore[arg-type]
    assert info.value.field == "inline_forward_below_s"
    with pytest.raises(InvalidConfigError) as info:
        RunnerSettings(model="builtin:tiny", inline_forward_below_s=value)  # type: ignore[arg-type]
    assert info.value.field == "inline_forward_below_s"


@pytest.mark.parametrize("value", [1, "true", None])
def test_not_a_bool_is_refused(value: object) -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(inline_forward=value)  # type: ignore[arg-type]
    assert info.value.field == "inline_forward"
    assert info.value.value == value


@pytest.mark.parametrize("executor", ["multiproc", "ray"])
def test_refused_with_worker_executors(executor: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(inline_forward=True, executor=executor, world_size=2)
    assert info.value.field == "inline_forward"
    assert "executor='inprocess'" in info.value.allowed
    assert executor in info.value.allowed
