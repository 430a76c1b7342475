"""``EngineConfig.inline_forward``: the forward pass and sampling run on the event loop's
thread, and nothing a request sees changes.

- The same requests give the same outputs (tokens, finish and stop reasons, logprobs)
  with the runner's compute thread and inline: greedy and seeded sampling, penalties,
  chunked prefill, without prefix caching, with the offload connector (whose layer
  hooks then run on the loop's thread), and with async scheduling on.
- Inline, the forward runs on the thread of the loop that awaits it and no compute
  thread exists; with the thread, it runs there (so the check can fail).
- A forward pass that raises (a real exception, inline on the loop) fails its own
  step's requests only: the engine goes on serving.
- A bad value, or inline with an executor whose ranks run in workers of their own, is
  refused with a typed error naming the field.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError
from stages.forward.compute_thread import ComputeThread, InlineCompute
from stages.forward.runner import ModelRunner
from tests.pipeline.test_async_scheduling import CASES, _config, _run

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_to_compute_thread(llama_path: Path, case: str) -> None:
    """Every request's outputs are the same whichever thread runs the forward pass."""
    config = _config(llama_path, **CASES[case])
    threaded = _run(attrs.evolve(config, inline_forward=False))
    inline = _run(attrs.evolve(config, inline_forward=True))
    assert inline == threaded
    assert {summary[1] for summary in threaded} >= {"length"}


def test_outputs_equal_with_async_scheduling(llama_path: Path) -> None:
    """Inline and async scheduling together: the same outputs as neither (the planned
    step then waits for the loop, which the forward pass holds)."""
    config = _config(llama_path)
    plain = _run(config)
    both = _run(attrs.evolve(config, inline_forward=True, async_scheduling=True))
    assert both == plain


def _record_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``ModelRunner.execute``: the ident of each thread that runs a forward pass."""
    threads: list[int] = []
    execute = ModelRunner.execute

    def recording(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return threads


async def _generate(engine: AsyncEngine, prompt: list[int], max_tokens: int = 4) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last


@pytest.mark.parametrize("inline", [True, False])
def test_forward_thread(llama_path: Path, monkeypatch: pytest.MonkeyPatch, *, inline: bool) -> None:
    """Inline: every forward pass runs on the loop's thread and no compute thread is
    alive. Otherwise: on the runner's compute thread, never on the loop's."""
    threads = _record_threads(monkeypatch)

    async def main() -> tuple[int, set[str], type]:
        loop_thread = threading.get_ident()
        async with AsyncEngine(_config(llama_path, inline_forward=inline)) as engine:
            out = await _generate(engine, [5, 6, 7])
            assert out is not None and len(out.token_ids) == 4
            names = {t.name for t in threading.enumerate()}
            compute = type(engine.core.workers[0].runner.compute)
        return loop_thread, names, compute

    loop_thread, names, compute = anyio.run(main)
    assert len(threads) >= 4
    compute_threads = {n for n in names if n.startswith("kvstep-compute")}
    if inline:
        assert set(threads) == {loop_thread}
        assert not compute_threads
        assert compute is InlineCompute
    else:
        assert loop_thread not in threads
        assert compute_threads
        assert compute is ComputeThread


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
