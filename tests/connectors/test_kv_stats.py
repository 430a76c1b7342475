"""get_kv_stats() returns a named KVStats, from every connector and through the stage."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorRole,
    KVConnectorWorker,
    ModelFingerprint,
)
from connectors.lifecycle import GuardedWorker
from connectors.multi import MultiWorker
from connectors.shared_storage import SharedStorageMetadata, SharedStorageWorker
from connectors.shared_storage.metadata import BlockRef
from connectors.testing import RecordingConnector
from connectors.testing.recording import RecordingMetadata
from pipeline.artifacts import KVStats, WorkerOutput

LAYERS, BLOCKS, BS = 2, 4, 4
FP = ModelFingerprint(architecture="llama", weights_id="w", dtype="float32", block_size=BS)


class _Bare(KVConnectorWorker):
    """A worker half that keeps every default."""


class TestKVStats:
    def test_fields_in_order_with_zero_defaults(self) -> None:
        """Four named int fields, zero by default; still the 4-tuple it replaced."""
        assert KVStats._fields == ("loaded_tokens", "loaded_bytes", "saved_tokens", "saved_bytes")
        stats = KVStats(loaded_tokens=1, loaded_bytes=2, saved_tokens=3, saved_bytes=4)
        assert stats == (1, 2, 3, 4) and stats[2] == stats.saved_tokens == 3
        assert KVStats() == (0, 0, 0, 0)

    def test_add_sums_and_merge_takes_the_most_tokens(self) -> None:
        """+ adds every field (no concatenation); merge maxes tokens and sums bytes."""
        a, b = KVStats(1, 10, 2, 20), KVStats(3, 30, 1, 40)
        assert a + b == KVStats(4, 40, 3, 60)
        assert a.merge(b) == KVStats(3, 40, 2, 60) == b.merge(a)

    def test_round_trips_the_wire_inside_a_worker_output(self) -> None:
        """msgspec carries it (as its 4-array) and gives the named tuple back."""
        out = WorkerOutput(rank=0, step_id=1, stats=KVStats(1, 2, 3, 4))
        again = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=WorkerOutput)
        assert type(again.stats) is KVStats and again.stats.saved_bytes == 4


class TestConnectorsReturnKVStats:
    def test_the_default_is_zero_kv_stats(self) -> None:
        """A worker half that does not override it reports zero KVStats."""
        stats = _Bare(ConnectorContext(role=KVConnectorRole.WORKER)).get_kv_stats()
        assert type(stats) is KVStats and stats == KVStats()

    def test_recording_and_the_guard(self) -> None:
        """The recording connector's answer is a KVStats; the guard hands it on."""
        ctx = ConnectorContext(role=KVConnectorRole.WORKER)
        guard = GuardedWorker(RecordingConnector.Worker(ctx))
        guard.begin_step(1)
        guard.bind_connector_metadata(RecordingMetadata(step_id=1))
        anyio.run(
            guard.start_load_kv,
            ForwardContext(step_id=1, rank=0, kv_caches=[], scheduler_output=None),
        )
        assert type(guard.get_kv_stats()) is KVStats
        guard.clear_connector_metadata()

    def test_a_store_worker_names_what_it_saved(self, tmp_path: Path) -> None:
        """shared_storage: a step saving 3 blocks reports them by name."""
        kv = [torch.randn(2, BLOCKS, BS, 2, 8) for _ in range(LAYERS)]
        ctx = ConnectorContext(
            role=KVConnectorRole.WORKER,
            options={"path": str(tmp_path)},
            block_size=BS,
            fingerprint=FP,
        )
        worker = SharedStorageWorker(ctx)
        worker.register_kv_caches(kv)
        refs = [BlockRef("r", b, bytes([b + 1]) * 32) for b in (0, 1, 3)]

        async def step() -> KVStats:
            worker.bind_connector_metadata(SharedStorageMetadata.build(1, [], refs))
            fctx = ForwardContext(step_id=1, rank=0, kv_caches=kv, scheduler_output=None)
            await worker.start_load_kv(fctx)
            for layer, t in enumerate(kv):
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer, t, fctx)
            await worker.wait_for_save()
            stats = worker.get_kv_stats()
            worker.clear_connector_metadata()
            await worker.aclose()
            return stats

        stats = anyio.run(step)
        assert type(stats) is KVStats
        assert (stats.loaded_tokens, stats.saved_tokens) == (0, 3 * BS)
        assert stats.saved_bytes > 0 and stats.loaded_bytes == 0

    def test_multi_sums_its_tiers_into_kv_stats(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """multi: the active tiers' stats, summed field by field (a tier answering the
        old plain 4-tuple is named too); a tier whose query raises counts nothing."""
        tiers = [{"connector": "recording"}, {"connector": "recording"}, {"connector": "recording"}]
        worker = MultiWorker(
            ConnectorContext(role=KVConnectorRole.WORKER, options={"tiers": tiers})
        )
        monkeypatch.setattr(worker.tiers[0], "get_kv_stats", lambda: KVStats(1, 10, 2, 20))
        monkeypatch.setattr(worker.tiers[1], "get_kv_stats", lambda: (3, 30, 0, 0))

        def boom() -> KVStats:
            raise RuntimeError("tier down")

        monkeypatch.setattr(worker.tiers[2], "get_kv_stats", boom)
        monkeypatch.setattr(worker, "_active", (0, 1, 2))
        stats = worker.get_kv_stats()
        assert type(stats) is KVStats and stats == KVStats(4, 40, 2, 20)
