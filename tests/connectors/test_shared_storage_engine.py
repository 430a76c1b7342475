"""The shared_storage connector in running engines: two engines, one after the other,
share a directory; the second loads the first's KV with outputs identical to a run
without any connector (prefix caching off, so every hit comes from the store)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import structlog
from checkpoints import build_checkpoint

from connectors.shared_storage import SharedStorageWorker
from connectors.shared_storage import loader as loader_mod
from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.block_hashes import hash_request_tokens

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def workload() -> list[list[int]]:
    """Shared prefixes: full sharing, a longer tail, a 2-block partial hit, unrelated."""
    rng = random.Random(11)
    base = [rng.randrange(1, 256) for _ in range(48)]
    return [
        [*base, *[rng.randrange(1, 256) for _ in range(5)]],
        [*base, *[rng.randrange(1, 256) for _ in range(27)]],
        [*base[:32], *[rng.randrange(1, 256) for _ in range(12)]],
        [rng.randrange(1, 256) for _ in range(37)],
    ]


def config(model: Path, store: Path | None, **overrides) -> EngineConfig:
    fields = dict(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=False,
        connector="shared_storage" if store is not None else None,
        connector_options={"path": str(store)} if store is not None else {},
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def full_blocks(prompt: list[int]) -> int:
    """Tokens a full hit loads: every full block but never the last token."""
    return (len(prompt) - 1) // BS * BS


def workers(llm: LLM) -> list[SharedStorageWorker]:
    found = [w.connector.inner for w in llm.engine.core.workers]
    assert all(isinstance(w, SharedStorageWorker) for w in found)
    return found


def run(model: Path, store: Path | None, prompts=None, **overrides):
    """Generate the workload on a fresh engine; returns (token ids, cached, stats)."""
    with LLM(config(model, store, **overrides)) as llm:
        outs = llm.generate(prompts or workload(), PARAMS)
        stats = [w.stats for w in workers(llm)] if store is not None else []
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs], stats


def values(store: Path) -> list[Path]:
    return sorted(store.glob("*/*/*.kv"))


@pytest.fixture(scope="module")
def reference(llama_path) -> list[tuple[int, ...]]:
    """Greedy outputs of the workload without a connector."""
    return run(llama_path, None)[0]


class TestTwoEngines:
    def test_second_engine_loads_every_full_block(self, llama_path, reference, tmp_path):
        """Engine 1 saves, engine 2 (a new LLM on the same dir) loads each prompt's full
        blocks; both match the reference; step log and stats agree."""
        store, log = tmp_path / "store", tmp_path / "steps.jsonl"
        first, cached1, (stats1,) = run(llama_path, store)
        assert first == reference and cached1 == [0, 0, 0, 0]
        assert stats1.saved_blocks == len(values(store)) > 0
        second, cached2, (stats2,) = run(llama_path, store, step_log=str(log))
        prompts = workload()
        assert second == reference
        assert cached2 == [full_blocks(p) for p in prompts]
        assert stats2.load_errors == 0 and stats2.failed_saves == 0
        assert stats2.loaded_blocks * BS == sum(full_blocks(p) for p in prompts)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [r for r in records if r.get("event") == "step" and r["kind"] == "engine"]
        assert sum(r["loaded_tokens"] for r in steps) == stats2.loaded_blocks * BS

    def test_partial_prefix_and_chunked_prefill(self, llama_path, reference, tmp_path):
        """Only the first prompt stored: the others hit its shared blocks (partial, at
        block granularity); with a 24-token budget outputs still match."""
        store, prompts = tmp_path / "store", workload()
        run(llama_path, store, prompts=prompts[:1], max_num_batched_tokens=24)
        out, cached, _ = run(llama_path, store, max_num_batched_tokens=24)
        assert out == reference
        assert cached == [48, 48, 32, 0]

    def test_two_ranks(self, llama_path, reference, tmp_path):
        """world_size=2: each rank writes under its own fingerprint; full hits."""
        store = tmp_path / "store"
        run(llama_path, store, world_size=2)
        assert len({p.parts[-3] for p in values(store)}) == 2
        out, cached, stats = run(llama_path, store, world_size=2)
        assert out == reference
        assert cached == [full_blocks(p) for p in workload()]
        assert stats[0] == stats[1] and stats[0].loaded_blocks > 0

    def test_max_bytes_caps_the_store(self, llama_path, reference, tmp_path):
        """A cap of ~3 values evicts older ones; outputs stay identical."""
        store = tmp_path / "store"
        run(llama_path, store, prompts=workload()[:1])
        one = values(store)[0].stat().st_size
        opts = {"path": str(store), "max_bytes": 3 * one}
        out, _, _ = run(llama_path, store, connector_options=opts)
        assert out == reference
        assert sum(p.stat().st_size for p in values(store)) <= 3 * one


class TestFaults:
    @pytest.mark.parametrize("fault", ["truncate", "bitflip", "missing", "foreign"])
    def test_damaged_values_are_recomputed(self, llama_path, reference, tmp_path, fault):
        """Damage every stored value between the runs: outputs identical, each damaged
        block a logged load error, nothing raised."""
        store = tmp_path / "store"
        run(llama_path, store)
        damaged = values(store)
        for path in damaged:
            data = bytearray(path.read_bytes())
            if fault == "truncate":
                path.write_bytes(data[: len(data) // 2])
            elif fault == "bitflip":
                data[-7] ^= 0x10
                path.write_bytes(data)
            elif fault == "missing":
                path.unlink()
            else:  # another block's (valid) value under this name
                other = next(p for p in damaged if p != path)
                path.write_bytes(other.read_bytes() if other.exists() else b"")
        with structlog.testing.capture_logs() as logs:
            out, _, (stats,) = run(llama_path, store)
        assert out == reference
        failed = [e for e in logs if e["event"] == "shared_storage: block load failed"]
        if fault == "missing":  # a miss at match time: nothing to load
            assert stats.loaded_blocks == 0
        else:
            assert stats.load_errors > 0 and stats.loaded_blocks == 0
            assert len(failed) == stats.load_errors
            assert all("FrameError" in e["error"] for e in failed)

    def test_slow_store_past_the_deadline(self, llama_path, reference, tmp_path, monkeypatch):
        """A reader slower than load_timeout_s: loads abandoned, outputs identical."""
        store = tmp_path / "store"
        run(llama_path, store)
        real = loader_mod.open_block

        def slow(*args, **kwargs):
            time.sleep(0.3)
            return real(*args, **kwargs)

        monkeypatch.setattr(loader_mod, "open_block", slow)
        opts = {"path": str(store), "load_timeout_s": 0.05}
        out, _, (stats,) = run(llama_path, store, connector_options=opts)
        assert out == reference
        assert stats.load_errors > 0

    @pytest.mark.parametrize("change", [{"dtype": "bfloat16"}, {"block_size": 32}, "weights"])
    def test_other_model_never_loads(self, llama_path, tmp_path, change):
        """Another dtype, block size or weights (same architecture) on the same dir:
        no hit at all, and each writes its own values."""
        store = tmp_path / "store"
        run(llama_path, store)
        before = set(values(store))
        model, overrides = llama_path, {}
        if change == "weights":
            model = build_checkpoint("llama", tmp_path / "llama-seed1", seed=1)
        else:
            overrides = dict(change)
        _, cached, (stats,) = run(model, store, **overrides)
        assert cached == [0, 0, 0, 0] and stats.loaded_blocks == 0
        assert stats.saved_blocks > 0 and before < set(values(store))

    def test_fail_policy_fails_only_the_damaged_request(self, llama_path, reference, tmp_path):
        """Under load_failure_policy="fail", a bit-flipped block of one prompt fails
        that request alone; the others load and match the reference."""
        store, prompts = tmp_path / "store", workload()
        run(llama_path, store)
        (folder,) = store.iterdir()
        name = hash_request_tokens(prompts[3], BS)[0].hex()
        path = folder / name[:2] / f"{name}.kv"
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x04
        path.write_bytes(data)
        with LLM(config(llama_path, store, load_failure_policy="fail")) as llm:
            outs = llm.generate(prompts, PARAMS)
        assert outs[3].finish_reason == "error"
        assert [o.token_ids for o in outs[:3]] == reference[:3]
