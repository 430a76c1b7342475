"""The runner's compute thread: one thread for loading and every step, context kept."""

from __future__ import annotations

import contextvars
import threading
from pathlib import Path

import anyio
import pytest

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from stages.model.compute_thread import ComputeThread, InlineCompute
from stages.model.runner import ModelRunner

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


class TestComputeThread:
    @pytest.mark.anyio
    async def test_calls_share_one_thread_and_the_callers_context(self) -> None:
        """call and run execute on the same thread, in order, with the caller's context."""
        compute = ComputeThread("test-compute")
        try:
            VAR.set("bound")
            first = compute.call(lambda: (threading.get_ident(), VAR.get()))
            later = [
                await compute.run(lambda: (threading.get_ident(), VAR.get())) for _ in range(3)
            ]
        finally:
            compute.close()
        assert {first, *later} == {(first[0], "bound")}
        assert first[0] != threading.get_ident()

    @pytest.mark.anyio
    async def test_inline_runs_here_in_a_copy_of_the_callers_context(self) -> None:
        """InlineCompute runs on the calling thread and sees the caller's context; what
        the call binds stays in its copy, as with the thread."""
        compute = InlineCompute("test-inline")
        VAR.set("bound")

        def call() -> tuple[int, str]:
            seen = VAR.get()
            VAR.set("set inside")
            return threading.get_ident(), seen

        assert await compute.run(call) == (threading.get_ident(), "bound")
        assert VAR.get() == "bound"
        assert compute.call(lambda: threading.get_ident()) == threading.get_ident()
        compute.close()

    @pytest.mark.anyio
    async def test_inline_checks_for_cancellation_before_the_call(self) -> None:
        """A run awaited in a cancelled scope does not call its function."""
        calls: list[int] = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            await InlineCompute("test-inline").run(calls.append, 1)
        assert scope.cancelled_caught and not calls

    def test_close_joins_the_thread(self) -> None:
        """After close no compute thread is left running."""
        compute = ComputeThread("test-compute-close")
        compute.call(lambda: None)
        compute.close()
        compute.close()  # idempotent
        assert not [t for t in threading.enumerate() if t.name.startswith("test-compute-close")]

    @pytest.mark.anyio
    async def test_a_runner_loads_and_steps_on_its_compute_thread(
        self, llama_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ModelRunner.load reads the weights on the thread that later runs every
        forward pass (a second thread's OpenMP pool would compete for the cores)."""
        from stages.model import runner_parts

        threads: list[int] = []
        real = runner_parts.load_model

        def load_model(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            threads.append(threading.get_ident())
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(runner_parts, "load_model", load_model)
        runner = ModelRunner.load(str(llama_path), dtype="float32", device="cpu", num_blocks=8)
        try:
            request = ScheduledRequest(
                req_id="a",
                token_ids=(1, 2, 3),
                num_computed_tokens=0,
                block_ids=(0,),
                new=True,
                sampling=SamplingParams(temperature=0.0),
                sample=True,
                num_output_tokens=0,
            )
            out = SchedulerOutput(step_id=0, requests=(request,))
            execute = runner.execute

            def traced(*args):  # type: ignore[no-untyped-def]
                threads.append(threading.get_ident())
                return execute(*args)

            await runner.compute.run(traced, out, None)
        finally:
            runner.close()
        assert len(threads) == 2 and threads[0] == threads[1]
