"""The ``ray`` executor on one machine (``ray.init(num_cpus=2)``): Ray actors as
tensor-parallel ranks give the single rank's greedy tokens, with and without the
shared_storage connector; a killed actor ends the engine with ``EngineDeadError``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

from pipeline import AsyncEngine, SamplingParams
from pipeline.errors import EngineDeadError

ray = pytest.importorskip("ray")

import test_multiproc_executor as multiproc  # noqa: E402
from test_multiproc_executor import config, generate, workload  # noqa: E402

# The same checkpoints and single-rank references as the multiproc tests (fixtures).
model = multiproc.model
reference = multiproc.reference


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """A local two-CPU Ray, started once for the module (no usage reporting)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class TestRayOutputs:
    def test_world_size_2_equals_world_size_1(self, model: Path, reference) -> None:
        """Two Ray actors, tensor-parallel, give the single rank's greedy tokens."""
        tokens, _ = generate(config(model, executor="ray", world_size=2))
        assert tokens == reference

    def test_shared_storage_round_trip(self, model: Path, reference, tmp_path: Path) -> None:
        """Ray ranks save their shards; a second engine loads every full block."""
        cfg = config(
            model,
            executor="ray",
            world_size=2,
            connector="shared_storage",
            connector_options={"path": str(tmp_path / "store")},
        )
        assert generate(cfg)[0] == reference
        second, cached = generate(cfg)
        assert second == reference
        assert cached == [(len(p) - 1) // 16 * 16 for p in workload()]


class TestRayActorDeath:
    @pytest.mark.timeout(120)
    @pytest.mark.anyio
    async def test_killed_actor_ends_every_request(self, llama_path: Path) -> None:
        """ray.kill of one rank's actor mid-generation: every in-flight generate raises
        EngineDeadError naming the rank, within the fan-in deadline."""
        cfg = config(llama_path, executor="ray", world_size=2)
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(cfg) as engine:
            actor = engine.core.executor._actors[1].handle  # type: ignore[attr-defined]
            errors: list[BaseException] = []
            started = anyio.Event()

            async def consume(prompt: list[int]) -> None:
                try:
                    async for out in engine.generate(prompt, params):
                        if len(out.token_ids) >= 4:
                            started.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for prompt in workload():
                        tg.start_soon(consume, prompt)
                    await started.wait()
                    ray.kill(actor)
                    killed = time.monotonic()
            assert len(errors) == len(workload())
            assert time.monotonic() - killed < 15
            assert all("rank 1" in str(e) for e in errors)
