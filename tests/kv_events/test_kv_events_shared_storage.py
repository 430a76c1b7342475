"""KV events of the shared_storage tier: medium ``"DISK"``, stored once a save landed,
removed when the engine's own eviction or a probe finds a value gone; an index rebuilt
from the stream equals the values in the directory for the engine's fingerprint."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from kv_events_helpers import BLOCK, engine_examples, requests
from store_events_helpers import (
    engine_config,
    run_waves,
    store_of,
    tier_events,
)

from connectors.shared_storage import MEDIUM_DISK, SharedStorageScheduler, naming
from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    prompt_block_digests,
    prompt_block_hashes,
)


def _values(root: Path, fingerprint_key: str) -> set[bytes]:
    """The hashes with a value file under ``fingerprint_key``."""
    return {
        bytes.fromhex(p.name.removesuffix(naming.SUFFIX))
        for p in (root / fingerprint_key).glob(f"*/*{naming.SUFFIX}")
    }


def _contents(engine: AsyncEngine) -> set[bytes]:
    """What the directory holds for the engine's fingerprint, every rank."""
    store = store_of(engine)
    assert isinstance(store, SharedStorageScheduler)
    per_rank = [_values(store.store.root, key) for key in store.fingerprint_keys]
    return set.intersection(*per_rank)


@functools.cache
def _value_bytes() -> int:
    """The size of one stored value of the builtin model (a store cap counts them)."""
    with tempfile.TemporaryDirectory() as directory:
        config = EngineConfig(
            block_size=BLOCK,
            num_gpu_blocks=14,
            max_model_len=48,
            connector="shared_storage",
            connector_options={"path": f"{directory}/store"},
        )
        with LLM(config) as llm:
            llm.generate([[50] * 5], SamplingParams(max_tokens=1))
        (value,) = Path(directory, "store").glob(naming.VALUE_GLOB)
        return value.stat().st_size


def _config(directory: str, connector: str = "shared_storage", **options: object) -> EngineConfig:
    options = {"path": f"{directory}/store", **options}
    if connector == "faulty":
        faults = options.pop("faults")
        options = {"inner": "shared_storage", "inner_options": options, "faults": faults}
    return engine_config(directory, connector, options)


request_st = requests(max_tokens=5, abort_after=2)


class TestExactness:
    # No shrinking: every example runs an engine, and a failing one is reported as found.
    @engine_examples(4)
    @given(
        waves=st.lists(st.lists(request_st, min_size=1, max_size=4), min_size=2, max_size=3),
        cap=st.sampled_from([2, 4, 8]),
    )
    def test_index_equals_the_directory(self, waves, cap) -> None:
        """Random waves (device evictions, loads from the store, aborts, the engine's
        own evictions under a cap of ``cap`` values): after each wave the index rebuilt
        from the stream equals the pool's hashes (GPU) and the directory's values
        (DISK), and a late subscriber replaying from 0 reaches the same state."""
        with tempfile.TemporaryDirectory() as directory:
            config = _config(directory, max_bytes=cap * _value_bytes())
            run = run_waves(config, waves, MEDIUM_DISK, _contents)
        for medium in (MEDIUM_GPU, MEDIUM_DISK):
            assert run.replayed.hashes(medium) == run.live.hashes(medium) == run.held[medium]
        assert len(run.held[MEDIUM_DISK]) <= cap

    def test_capped_store_evicts_and_says_so(self, tmp_path: Path) -> None:
        """Twelve blocks into a store capped at four values: DISK events store hashes
        only and remove the evicted ones; over the cap the store is evicted down to 90%
        of it (three values), and the index equals the three values left."""
        config = _config(str(tmp_path), max_bytes=4 * _value_bytes())
        waves = [[(0, 0, [60 + i] * 12, 1, None)] for i in range(3)]
        run = run_waves(config, waves, MEDIUM_DISK, _contents)
        disk = tier_events(run.events, MEDIUM_DISK)
        assert {type(e) for e in disk} == {BlockStored, BlockRemoved}
        stored = [e for e in disk if isinstance(e, BlockStored)]
        assert all(e.token_ids == [] and e.parent_block_hash is None for e in stored)
        assert len(run.held[MEDIUM_DISK]) == 3
        assert run.live.hashes(MEDIUM_DISK) == run.held[MEDIUM_DISK]

    def test_hashes_are_the_device_tiers(self, tmp_path: Path) -> None:
        """A prompt's DISK hashes are the ones its GPU events carry and a router computes
        (same chained digests, same wire format)."""
        prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 1, 3, 9]  # 3 full blocks
        run = run_waves(_config(str(tmp_path)), [[(0, 0, prompt, 1, None)]], MEDIUM_DISK, _contents)
        expected = set(prompt_block_hashes(prompt, BLOCK))
        assert run.live.hashes(MEDIUM_DISK) == expected
        assert expected <= run.live.hashes(MEDIUM_GPU)


class TestObserved:
    def test_values_deleted_behind_the_engine_are_removed_then_stored_again(
        self, tmp_path: Path
    ) -> None:
        """Another party deletes a prompt's values: the next request for it (the device
        has evicted it) finds them missing, says BlockRemoved, computes and stores them
        again; the index equals the directory at the end of every wave."""
        prompt = [9] * 13
        hashes = prompt_block_hashes(prompt, BLOCK)
        filler = [[(0, 0, [70 + i] * 13, 1, None)] for i in range(4)]  # evict the device
        waves = [[(0, 0, prompt, 1, None)], *filler, [(0, 0, prompt, 1, None)]]

        def wipe(engine: AsyncEngine, n: int) -> None:
            if n == len(filler):
                store = store_of(engine)
                assert isinstance(store, SharedStorageScheduler)
                for digest in prompt_block_digests(prompt, BLOCK):
                    store.store.path_for(store.fingerprint_keys[0], digest).unlink()

        run = run_waves(_config(str(tmp_path)), waves, MEDIUM_DISK, _contents, wipe)
        disk = tier_events(run.events, MEDIUM_DISK)
        for block_hash in hashes:
            kinds = [type(e) for e in disk if block_hash in getattr(e, "block_hashes", ())]
            assert kinds == [BlockStored, BlockRemoved, BlockStored]
        assert set(hashes) <= run.live.hashes(MEDIUM_DISK) == run.held[MEDIUM_DISK]


class TestFailures:
    def test_failed_saves_are_never_announced(self, tmp_path: Path) -> None:
        """Every save reported failed (faulty wait_for_save): no DISK event, though the
        workers wrote values (the engine never confirmed them)."""
        fault = {"call": "wait_for_save", "action": "corrupt", "times": None}
        config = _config(str(tmp_path), "faulty", faults=[fault])
        waves = [[(0, 0, [50 + i] * 13, 2, None)] for i in range(3)]
        run = run_waves(config, waves, MEDIUM_DISK, lambda engine: set())
        assert tier_events(run.events, MEDIUM_DISK) == []
        assert list((tmp_path / "store").glob(naming.VALUE_GLOB)) != []

    def test_a_failed_load_of_a_value_still_there_removes_nothing(self, tmp_path: Path) -> None:
        """Every load reported failed (faulty): each failed hash is probed again, found,
        and stays announced; the index still equals the directory."""
        fault = {"call": "get_block_ids_with_load_errors", "action": "corrupt", "times": None}
        config = _config(str(tmp_path), "faulty", faults=[fault])
        prefix = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 1, 3, 9, 9, 2, 7]
        waves = [[(0, 0, [*prefix, 30], 1, None)]]
        waves += [[(0, 0, [60 + i] * 13, 1, None)] for i in range(4)]
        waves += [[(0, 0, [*prefix, 31], 1, None)]]
        run = run_waves(config, waves, MEDIUM_DISK, _contents)
        assert not any(isinstance(e, BlockRemoved) for e in tier_events(run.events, MEDIUM_DISK))
        assert run.live.hashes(MEDIUM_DISK) == run.held[MEDIUM_DISK]


class TestEventsOff:
    def test_no_sink_no_events(self, tmp_path: Path) -> None:
        """Without kv_events the store tier has no event state and works as before."""
        config = EngineConfig(
            block_size=BLOCK,
            num_gpu_blocks=14,
            max_model_len=48,
            connector="shared_storage",
            connector_options={"path": str(tmp_path / "store")},
        )
        with LLM(config) as llm:
            store = store_of(llm.engine)
            assert llm.engine.core.kv_events is None and store.kv_events is None
            llm.generate([[60 + i] * 13 for i in range(3)], SamplingParams(max_tokens=2))
            assert store.kv_events is None
            assert len(_values(tmp_path / "store", store.fingerprint_keys[0])) == 9
