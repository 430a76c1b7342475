"""The shared_storage worker half and its store, driven directly (no engine)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import structlog
import torch

from connectors.base import ConnectorContext, ForwardContext, KVConnectorRole, ModelFingerprint
from connectors.shared_storage import (
    DiskStore,
    SharedStorageMetadata,
    SharedStorageOptions,
    SharedStorageWorker,
)
from connectors.shared_storage import loader as loader_mod
from connectors.shared_storage.metadata import BlockRef
from pipeline.errors import InvalidConfigError

LAYERS, BLOCKS, BS = 3, 8, 4
FP = ModelFingerprint(architecture="llama", weights_id="w", dtype="float32", block_size=BS)


def cache(fill: float | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (2, BLOCKS, BS, 2, 8)
    if fill is not None:
        return [torch.full(shape, fill) for _ in range(LAYERS)]
    return [torch.randn(shape, generator=gen) for _ in range(LAYERS)]


def make_worker(path: Path, kv: list[torch.Tensor], **options) -> SharedStorageWorker:
    ctx = ConnectorContext(
        role=KVConnectorRole.WORKER,
        options={"path": str(path), **options},
        block_size=BS,
        fingerprint=FP,
    )
    worker = SharedStorageWorker(ctx)
    worker.register_kv_caches(kv)
    return worker


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(1, n + 1)]


async def step(worker, kv, meta) -> tuple[frozenset[str], frozenset[int]]:
    """One worker step: bind, load, per-layer wait + save, wait_for_save, errors, clear."""
    worker.bind_connector_metadata(meta)
    ctx = ForwardContext(step_id=meta.step_id, rank=0, kv_caches=kv, scheduler_output=None)
    await worker.start_load_kv(ctx)
    for layer, t in enumerate(kv):
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer, t, ctx)
    failed = await worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return failed, errors


def saves(hs: list[bytes], block_ids: list[int]) -> SharedStorageMetadata:
    refs = [BlockRef("r", b, h) for b, h in zip(block_ids, hs, strict=True)]
    return SharedStorageMetadata.build(1, [], refs)


def loads(hs: list[bytes], block_ids: list[int]) -> SharedStorageMetadata:
    refs = [BlockRef("q", b, h) for b, h in zip(block_ids, hs, strict=True)]
    return SharedStorageMetadata.build(2, refs, [])


class TestWorker:
    @pytest.mark.anyio
    async def test_save_then_load_into_another_cache(self, tmp_path):
        """Blocks saved from one cache load bit for bit into other block ids."""
        src, dst = cache(), cache(fill=0.0)
        writer, reader = make_worker(tmp_path, src), make_worker(tmp_path, dst)
        hs = hashes(3)
        assert await step(writer, src, saves(hs, [1, 4, 6])) == (frozenset(), frozenset())
        assert writer.get_kv_stats()[2] == 3 * BS
        assert await step(reader, dst, loads(hs, [0, 2, 3])) == (frozenset(), frozenset())
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [0, 2, 3]], s[:, [1, 4, 6]])
        assert reader.stats.loaded_blocks == 3
        await writer.aclose()
        await reader.aclose()

    @pytest.mark.anyio
    async def test_missing_at_load_time_is_a_load_error(self, tmp_path):
        """A value gone between match and load fails that block only, logged."""
        src, dst = cache(), cache(fill=0.0)
        writer, reader = make_worker(tmp_path, src), make_worker(tmp_path, dst)
        hs = hashes(2)
        await step(writer, src, saves(hs, [1, 2]))
        writer.store.path_for(FP.key(), hs[0]).unlink()
        with structlog.testing.capture_logs() as logs:
            _, errors = await step(reader, dst, loads(hs, [5, 6]))
        assert errors == {5}
        assert any(e["event"] == "shared_storage: block load failed" for e in logs)
        assert torch.equal(dst[0][:, 6], src[0][:, 2])
        await writer.aclose()
        await reader.aclose()

    @pytest.mark.anyio
    async def test_write_failure_is_reported_not_raised(self, tmp_path, monkeypatch):
        """A full disk fails the request's save; wait_for_save returns it, no raise."""
        src = cache()
        worker = make_worker(tmp_path, src)

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(worker.store, "write", full)
        failed, _ = await step(worker, src, saves(hashes(1), [1]))
        assert failed == {"r"} and worker.stats.failed_saves == 1
        await worker.aclose()

    @pytest.mark.anyio
    async def test_abandoned_reader_never_writes_into_the_cache(self, tmp_path, monkeypatch):
        """Past the deadline the blocks fail; the reader, released later, copies nothing."""
        src, dst = cache(), cache(fill=0.0)
        writer = make_worker(tmp_path, src)
        hs = hashes(2)
        await step(writer, src, saves(hs, [1, 2]))
        gate, real = threading.Event(), loader_mod.open_block

        def stuck(*args, **kwargs):
            gate.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(loader_mod, "open_block", stuck)
        reader = make_worker(tmp_path, dst, load_timeout_s=0.05)
        _, errors = await step(reader, dst, loads(hs, [3, 4]))
        assert errors == {3, 4}
        gate.set()
        for load in reader._abandoned:
            load.join(5)
            assert load.done.is_set()
        assert all(torch.count_nonzero(t) == 0 for t in dst)
        await writer.aclose()
        await reader.aclose()


class TestStore:
    def test_keys_cannot_escape_the_root(self, tmp_path):
        """Non-hex fingerprint keys and symlinks out of the root are refused."""
        store = DiskStore(tmp_path / "root")
        for bad in ("../../etc", "AB", "ab/cd", ""):
            with pytest.raises(InvalidConfigError):
                store.path_for(bad, b"\x01" * 32)
        crafted = store.path_for("ab", b"../../x")
        assert crafted.resolve().is_relative_to(store.root)
        outside = tmp_path / "outside"
        outside.mkdir()
        (store.root / "cd").symlink_to(outside)
        with pytest.raises(InvalidConfigError, match="must lie under"):
            store.path_for("cd", b"\x01" * 32)

    def test_write_is_atomic_and_leaves_no_temp(self, tmp_path):
        """A write replaces the value as a whole; no temp file remains."""
        store = DiskStore(tmp_path)
        store.write("ab", b"\x01", b"one")
        store.write("ab", b"\x01", b"two")
        path = store.path_for("ab", b"\x01")
        assert path.read_bytes() == b"two"
        assert [p.name for p in path.parent.iterdir()] == [path.name]

    def test_eviction_keeps_recently_accessed(self, tmp_path):
        """Over max_bytes, the least recently accessed values go first, down to the low
        water mark (90% of 300 bytes: two of the five values stay)."""
        store = DiskStore(tmp_path)
        keys = [bytes([i]) for i in range(5)]
        for age, key in enumerate(keys):
            store.write("ab", key, b"x" * 100)
            t = 1_000_000 + age
            os.utime(store.path_for("ab", key), (t, t))
        store.touch(store.path_for("ab", keys[0]))  # the oldest, read just now
        assert store.evict(300) == 3
        assert [store.contains("ab", k) for k in keys] == [True, False, False, False, True]
        assert store.evict(300) == 0  # under the cap: nothing more, and no scan

    def test_eviction_under_the_cap_removes_nothing(self, tmp_path):
        store = DiskStore(tmp_path)
        for key in (b"\x01", b"\x02"):
            store.write("ab", key, b"x" * 100)
        assert store.evict(200) == 0
        assert store.contains("ab", b"\x01") and store.contains("ab", b"\x02")


class TestOptions:
    @pytest.mark.parametrize(
        "options",
        [
            {},
            {"path": ""},
            {"path": "/x", "max_bytes": 0},
            {"path": "/x", "bogus": 1},
            {"path": "/x", "load_timeout_s": -1},
            {"path": "/x", "max_bytes": True},
        ],
    )
    def test_bad_options_are_refused(self, options):
        """No path, an unknown option or a bad value raises InvalidConfigError."""
        with pytest.raises(InvalidConfigError):
            SharedStorageOptions.from_options(options)

    def test_metadata_round_trips_without_pickle(self):
        """The metadata encodes to bytes and back."""
        meta = SharedStorageMetadata.build(3, [BlockRef("a", 1, b"h")], [BlockRef("b", 2, b"g")])
        assert SharedStorageMetadata.from_bytes(meta.to_bytes()) == meta
