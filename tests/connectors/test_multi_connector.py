"""The multi (tiered) connector in a running engine: outputs identical to a run without
a connector, hits on the second run, promotion to faster tiers, the lifecycle, and a
tier that raises (prefix caching off, so every hit comes from a tier)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import anyio
import pytest

from connectors.multi import MultiScheduler, MultiWorker
from connectors.offload import OffloadScheduler, OffloadWorker
from connectors.testing import RecordingConnector, check_lifecycle
from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.block_hashes import hash_request_tokens

BS = 16
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
HAS_SHARED_STORAGE = importlib.util.find_spec("connectors.shared_storage") is not None


def workload() -> list[list[int]]:
    """Shared prefixes (a full and a 2-block partial hit) and an unrelated prompt."""
    rng = random.Random(11)
    base = [rng.randrange(1, 256) for _ in range(48)]
    return [
        [*base, *[rng.randrange(1, 256) for _ in range(7)]],
        [*base[:32], *[rng.randrange(1, 256) for _ in range(20)]],
        [rng.randrange(1, 256) for _ in range(37)],
    ]


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS * BS


def offload(blocks: int) -> dict[str, Any]:
    return {"connector": "offload", "options": {"num_blocks": blocks}}


def config(path: Path, tiers: list[dict[str, Any]] | None, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = dict(
        model=str(path), dtype="float32", max_model_len=256, enable_prefix_caching=False
    )
    if tiers is not None:
        fields.update(connector="multi", connector_options={"tiers": tiers})
    fields.update(overrides)
    return EngineConfig(**fields)


def scheduler(llm: LLM) -> MultiScheduler:
    found = llm.engine.core.connector
    assert isinstance(found, MultiScheduler)
    return found


def worker(llm: LLM) -> MultiWorker:
    found = llm.engine.core.workers[0].connector.inner
    assert isinstance(found, MultiWorker)
    return found


def holds(tier: OffloadScheduler, prompt: list[int], count: int) -> bool:
    """Whether ``tier``'s index holds the first ``count`` blocks of ``prompt``."""
    hashes = hash_request_tokens(prompt, BS)[:count]
    return all(tier.index.lookup((tier.fingerprint_key, h)) is not None for h in hashes)


@pytest.fixture(scope="module")
def reference(llama_path) -> list[tuple[int, ...]]:
    with LLM(config(llama_path, None)) as llm:
        return [o.token_ids for o in llm.generate(workload(), PARAMS)]


def tier_sets(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    sets = {"offload+offload": [offload(4), offload(64)]}
    if HAS_SHARED_STORAGE:
        shared = {"connector": "shared_storage", "options": {"path": str(tmp_path / "kv")}}
        sets["offload+shared_storage"] = [offload(64), shared]
    return sets


class TestTiers:
    @pytest.mark.parametrize("kind", ["offload+offload", "offload+shared_storage"])
    def test_outputs_identical_and_second_run_hits(self, llama_path, reference, tmp_path, kind):
        """Both runs match the no-connector reference; the second loads every full block."""
        tiers = tier_sets(tmp_path).get(kind)
        if tiers is None:
            pytest.skip("connectors.shared_storage is not there yet")
        prompts = workload()
        with LLM(config(llama_path, tiers)) as llm:
            assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == reference
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference
            assert [o.num_cached_tokens for o in second] == [full_blocks(p) for p in prompts]

    @pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
    def test_longest_hit_wins_and_is_promoted_to_the_faster_tier(
        self, llama_path, reference, async_load
    ):
        """A 3-slot first tier lost the start of the prompt: the second tier's longer
        hit is loaded, and afterwards the first tier's index holds every loaded block."""
        prompts = workload()
        slow_tier = offload(64)
        slow_tier["options"]["async_load"] = async_load
        with LLM(config(llama_path, [offload(3), slow_tier])) as llm:
            fast, slow = scheduler(llm).tiers
            assert isinstance(fast, OffloadScheduler) and isinstance(slow, OffloadScheduler)
            llm.generate(prompts[:1], PARAMS)  # 3 blocks into both tiers
            llm.generate(prompts[2:], PARAMS)  # 2 more: the 3-slot tier evicts (LRU)
            assert holds(slow, prompts[0], 3) and not holds(fast, prompts[0], 1)
            second = llm.generate(prompts[:1], PARAMS)
            assert [o.token_ids for o in second] == reference[:1]
            assert second[0].num_cached_tokens == 48  # all 3 blocks, from the slow tier
            assert holds(fast, prompts[0], 3)  # promoted
            stats = [w.stats for w in worker(llm).tiers if isinstance(w, OffloadWorker)]
            assert stats[0].load_errors == stats[1].load_errors == 0
            third = llm.generate(prompts[:1], PARAMS)
            assert [o.token_ids for o in third] == reference[:1]
            assert third[0].num_cached_tokens == 48

    def test_ties_load_from_the_first_tier(self, llama_path, reference):
        """Both tiers hold the prompt: the first (fastest) tier does the loading."""
        prompts = workload()
        with LLM(config(llama_path, [offload(64), offload(64)])) as llm:
            llm.generate(prompts, PARAMS)
            first, second = (w for w in worker(llm).tiers if isinstance(w, OffloadWorker))
            before = (first.stats.loaded_blocks, second.stats.loaded_blocks)
            again = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in again] == reference
            assert first.stats.loaded_blocks > before[0]
            assert second.stats.loaded_blocks == before[1]


class TestFaults:
    def test_a_tier_that_raises_does_not_break_the_others(self, llama_path, reference, monkeypatch):
        """The slow tier raises in its layer-load hook, get_finished, its stats and its
        load errors: outputs stay identical, the first tier still saves and serves every
        hit, and the clear reaches every tier on every step."""
        prompts = workload()
        with LLM(config(llama_path, [offload(64), offload(64)])) as llm:
            fast, slow = worker(llm).tiers
            cleared: list[int] = []

            def boom(*args: object) -> None:
                raise RuntimeError("injected tier fault")

            async def aboom(*args: object) -> None:
                raise RuntimeError("injected tier fault")

            real_clear = slow.clear_connector_metadata

            def clear() -> None:
                cleared.append(1)
                real_clear()

            for name in ("wait_for_layer_load", "get_kv_stats", "get_block_ids_with_load_errors"):
                monkeypatch.setattr(slow, name, boom)
            monkeypatch.setattr(slow, "get_finished", aboom)
            monkeypatch.setattr(slow, "clear_connector_metadata", clear)
            assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == reference
            steps = len(cleared)
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference
            assert [o.num_cached_tokens for o in second] == [full_blocks(p) for p in prompts]
            assert isinstance(fast, OffloadWorker) and fast.stats.loaded_blocks > 0
            assert steps > 0 and len(cleared) > steps

    def test_a_tier_whose_save_raises_never_keeps_partial_kv(
        self, llama_path, reference, monkeypatch
    ):
        """The slow tier's save hook raises: every request of those steps is reported as
        a failed save, so no tier commits KV that may be partial; outputs stay identical."""
        prompts = workload()
        with LLM(config(llama_path, [offload(64), offload(64)])) as llm:
            slow = worker(llm).tiers[1]

            def boom(*args: object) -> None:
                raise RuntimeError("injected save fault")

            monkeypatch.setattr(slow, "save_kv_layer", boom)
            assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == reference
            assert [len(t.index) for t in scheduler(llm).tiers] == [0, 0]
            monkeypatch.undo()
            assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == reference
            assert all(len(t.index) > 0 for t in scheduler(llm).tiers)
            third = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in third] == reference
            assert [o.num_cached_tokens for o in third] == [full_blocks(p) for p in prompts]

    def test_a_failing_load_tier_is_recomputed(self, llama_path, reference, monkeypatch):
        """The only tier with a hit raises in start_load_kv: its blocks are reported as
        load errors and recomputed, so outputs stay identical."""
        prompts = workload()
        with LLM(config(llama_path, [offload(64), offload(64)])) as llm:
            llm.generate(prompts, PARAMS)
            fast_sched = scheduler(llm).tiers[0]
            assert isinstance(fast_sched, OffloadScheduler)
            for key in list(fast_sched.index._committed):
                fast_sched.index.discard(key)  # only the slow tier holds the KV now
            slow = worker(llm).tiers[1]

            async def boom(ctx: object) -> None:
                raise RuntimeError("injected load fault")

            monkeypatch.setattr(slow, "start_load_kv", boom)
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference
            assert [o.num_cached_tokens for o in second] == [0, 0, 0]


class TestLifecycle:
    @pytest.mark.anyio
    async def test_two_ranks_concurrent_streams_lifecycle(self, llama_path, leak_check):
        """Multi over [recording, offload] on two ranks: the recording tier sees every
        call in lifecycle order on each rank, and nothing leaks."""
        RecordingConnector.reset()
        tiers = [{"connector": "recording", "options": {}}, offload(64)]
        results: list[tuple[int, ...]] = []

        async def consume(engine: AsyncEngine, prompt: list[int]) -> None:
            async for out in engine.generate(prompt, PARAMS):
                if out.finished:
                    results.append(out.token_ids)

        async with AsyncEngine(config(llama_path, tiers, world_size=2)) as engine:
            for _ in range(2):
                async with anyio.create_task_group() as tg:
                    for prompt in workload():
                        tg.start_soon(consume, engine, prompt)
            leak_check(engine.leak_report())
        assert len(results) == 2 * len(workload())
        assert check_lifecycle(RecordingConnector.calls) == []
        ranks = {c.rank for c in RecordingConnector.calls if c.role == "worker"}
        assert ranks == {0, 1}
