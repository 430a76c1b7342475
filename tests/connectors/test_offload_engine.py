"""The offload connector in a running engine: KV reuse with outputs identical to a run
without any connector (prefix caching off, so every hit comes from the tier)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import pytest

from connectors.offload import OffloadScheduler, OffloadWorker
from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.block_hashes import hash_request_tokens

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def workload() -> list[list[int]]:
    """Shared prefixes: full sharing, a longer tail, a 2-block partial hit, unrelated."""
    rng = random.Random(7)
    base = [rng.randrange(1, 256) for _ in range(48)]
    return [
        [*base, *[rng.randrange(1, 256) for _ in range(5)]],
        [*base, *[rng.randrange(1, 256) for _ in range(27)]],
        [*base[:32], *[rng.randrange(1, 256) for _ in range(12)]],
        [rng.randrange(1, 256) for _ in range(37)],
    ]


def config(path: Path, **overrides) -> EngineConfig:
    fields = dict(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=False,
        connector="offload",
        connector_options={"num_blocks": 64},
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def full_blocks(prompt: list[int]) -> int:
    """Tokens a full hit loads: every full block but never the last token."""
    return (len(prompt) - 1) // BS * BS


def workers(llm: LLM) -> list[OffloadWorker]:
    found = [w.connector.inner for w in llm.engine.core.workers]
    assert all(isinstance(w, OffloadWorker) for w in found)
    return found


@pytest.fixture(scope="module")
def reference(tiny_checkpoints) -> dict[str, list[tuple[int, ...]]]:
    """Greedy outputs of the workload without a connector, per architecture."""
    refs = {}
    for kind in ("llama", "qwen2"):
        with LLM(config(tiny_checkpoints[kind], connector=None, connector_options={})) as llm:
            refs[kind] = [o.token_ids for o in llm.generate(workload(), PARAMS)]
    return refs


class TestReuse:
    @pytest.mark.parametrize("kind", ["llama", "qwen2"])
    def test_second_run_loads_every_full_block_with_identical_outputs(
        self, tiny_checkpoints, reference, kind, tmp_path
    ):
        """Run twice on one engine: both runs match the reference; the second loads
        each prompt's full blocks (partial hit included), seen in the outputs, the
        workers' stats and the step log."""
        log = tmp_path / "steps.jsonl"
        prompts = workload()
        with LLM(config(tiny_checkpoints[kind], step_log=str(log))) as llm:
            first = llm.generate(prompts, PARAMS)
            (worker,) = workers(llm)
            saved = worker.stats.saved_blocks
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in first] == reference[kind]
            assert [o.token_ids for o in second] == reference[kind]
            assert [o.num_cached_tokens for o in second] == [full_blocks(p) for p in prompts]
            stats = worker.stats
            assert stats.load_errors == 0 and stats.failed_saves == 0
            assert stats.loaded_blocks * BS >= sum(full_blocks(p) for p in prompts)
            assert saved > 0 and stats.saved_blocks >= saved
        records = [json.loads(line) for line in log.read_text().splitlines()]
        engine_steps = [r for r in records if r.get("event") == "step" and r["kind"] == "engine"]
        assert sum(r["loaded_tokens"] for r in engine_steps) == stats.loaded_blocks * BS
        assert sum(r["saved_tokens"] for r in engine_steps) == stats.saved_blocks * BS

    def test_chunked_prefill(self, llama_path, reference):
        """With a 24-token budget (chunks across block boundaries) reuse still matches."""
        prompts = workload()
        with LLM(config(llama_path, max_num_batched_tokens=24)) as llm:
            assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == reference["llama"]
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference["llama"]
            assert [o.num_cached_tokens for o in second] == [full_blocks(p) for p in prompts]

    def test_two_ranks_each_keep_their_own_pool(self, llama_path, reference):
        """world_size=2: same outputs and hits; each rank's slots carry its own key."""
        prompts = workload()
        with LLM(config(llama_path, world_size=2)) as llm:
            llm.generate(prompts, PARAMS)
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference["llama"]
            assert [o.num_cached_tokens for o in second] == [full_blocks(p) for p in prompts]
            rank0, rank1 = workers(llm)
            assert rank0.key_prefix != rank1.key_prefix
            assert rank0.stats == rank1.stats and rank0.stats.loaded_blocks > 0
            for worker in (rank0, rank1):
                held = [k for k in worker.pool.keys if k is not None]
                assert held and all(k.startswith(worker.key_prefix) for k in held)

    def test_tiny_pool_evicts_but_outputs_stay_identical(self, llama_path, reference):
        """A 3-slot tier holds only the shared prefix: partial hits, LRU eviction on
        every later save, and outputs identical to the reference throughout."""
        prompts = workload()
        with LLM(config(llama_path, connector_options={"num_blocks": 3})) as llm:
            llm.generate(prompts[:1], PARAMS)  # fills the tier with the 3 base blocks
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference["llama"]
            assert [o.num_cached_tokens for o in second] == [48, 48, 32, 0]
            third = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in third] == reference["llama"]
            assert sum(o.num_cached_tokens for o in third) < sum(map(full_blocks, prompts))
            assert len(llm.engine.core.connector.index) == 3

    def test_preemption_resumes_from_the_tier(self, llama_path, monkeypatch):
        """With a 14-block cache, requests are preempted and resume (new block tables);
        outputs match a run without a connector."""
        prompts = workload()
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        small = dict(num_gpu_blocks=14, connector=None, connector_options={})
        with LLM(config(llama_path, **small)) as llm:
            expected = [o.token_ids for o in llm.generate(prompts, params)]
        admissions: list[str] = []
        with LLM(config(llama_path, num_gpu_blocks=14)) as llm:
            connector = llm.engine.core.connector
            real = connector.update_state_after_alloc

            def counting(request, block_ids, num_external_tokens):
                admissions.append(request.request_id)
                real(request, block_ids, num_external_tokens)

            monkeypatch.setattr(connector, "update_state_after_alloc", counting)
            assert [o.token_ids for o in llm.generate(prompts, params)] == expected
            assert len(admissions) > len(prompts)  # someone was preempted and resumed
            assert [o.token_ids for o in llm.generate(prompts, params)] == expected
            assert workers(llm)[0].stats.load_errors == 0

    @pytest.mark.timeout(120)
    def test_async_loads_under_block_pressure_do_not_deadlock(self, llama_path):
        """Parked async loads keep room for their next token: with a 14-block cache and
        preemption, every request still completes with the outputs of a plain run."""
        prompts = workload()
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        small = dict(num_gpu_blocks=14, connector=None, connector_options={})
        with LLM(config(llama_path, **small)) as llm:
            expected = [o.token_ids for o in llm.generate(prompts, params)]
        options = {"num_blocks": 64, "async_load": True}
        with LLM(config(llama_path, num_gpu_blocks=14, connector_options=options)) as llm:
            for _ in range(3):
                assert [o.token_ids for o in llm.generate(prompts, params)] == expected

    def test_async_load(self, llama_path, reference):
        """With async_load, hits park the request until loaded; outputs are identical."""
        prompts = workload()
        options = {"num_blocks": 64, "async_load": True}
        with LLM(config(llama_path, connector_options=options)) as llm:
            llm.generate(prompts, PARAMS)
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference["llama"]
            assert [o.num_cached_tokens for o in second] == [full_blocks(p) for p in prompts]
            assert not llm.engine.core.connector.has_pending_work()


class TestCorruption:
    def test_overwritten_slot_is_a_load_error_and_is_recomputed(self, llama_path, reference):
        """A slot overwritten by hand with another key's content is reported as a load
        error, the request recomputes (same output), and the block is stored again."""
        prompts = workload()
        with LLM(config(llama_path)) as llm:
            llm.generate(prompts, PARAMS)
            connector = llm.engine.core.connector
            assert isinstance(connector, OffloadScheduler)
            (worker,) = workers(llm)
            key = (connector.fingerprint_key, hash_request_tokens(prompts[3], BS)[1])
            slot = connector.index.lookup(key)
            assert slot is not None
            worker.pool.keys[slot] = worker.key_prefix + bytes(32)
            for layer in worker.pool.layers:
                layer[slot].normal_()
            second = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in second] == reference["llama"]
            assert worker.stats.load_errors == 1
            assert connector.index.lookup(key) is not None  # recomputed, stored again
            third = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in third] == reference["llama"]
            assert [o.num_cached_tokens for o in third] == [full_blocks(p) for p in prompts]
            assert worker.stats.load_errors == 1


class TestLifecycle:
    @pytest.mark.anyio
    async def test_async_engine_two_ranks_lifecycle_and_no_leaks(self, llama_path, leak_check):
        """Concurrent streams on two ranks: every connector call passes the lifecycle
        guard (an out-of-order call would fail a step), nothing leaks, nothing stays
        bound, and aclose stops every loader thread."""
        results: dict[int, tuple[int, ...]] = {}

        async def consume(engine: AsyncEngine, index: int, prompt: list[int]) -> None:
            async for out in engine.generate(prompt, PARAMS):
                if out.finished:
                    assert out.finish_reason == "length", out
                    results[index] = out.token_ids

        async with AsyncEngine(config(llama_path, world_size=2)) as engine:
            for _ in range(2):
                async with anyio.create_task_group() as tg:
                    for index, prompt in enumerate(workload()):
                        tg.start_soon(consume, engine, index, prompt)
            await engine.core.step()  # an empty step clears too
            leak_check(engine.leak_report())
            inner = [w.connector.inner for w in engine.core.workers]
            assert all(w.connector.connector_metadata is None for w in engine.core.workers)
        assert len(results) == len(workload())
        assert all(w.pool is None for w in inner)
        threads = [w._loader._thread for w in inner]
        assert not any(t.is_alive() for t in threads)
