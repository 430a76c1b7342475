"""RedisWorker against a real redis-server, without an engine: saves and per-layer
loads round-trip exactly; missing values, a dead server and a late reply are load errors
or failed saves, never exceptions and never wrong data in the paged cache."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from ports import free_port

from connectors.base import ConnectorContext, ForwardContext, KVConnectorRole, ModelFingerprint
from connectors.redis_store import RedisMetadata, RedisStore, RedisWorker
from connectors.redis_store.metadata import BlockTransfer

BS, LAYERS, HEADS, DIM, BLOCKS = 4, 3, 2, 8, 8
H1, H2 = b"\x01" * 32, b"\x02" * 32


def make(url: str, prefix: str, **opts) -> tuple[RedisWorker, list[torch.Tensor]]:
    fp = ModelFingerprint(architecture="A", weights_id="w", dtype="float32", block_size=BS)
    context = ConnectorContext(
        role=KVConnectorRole.WORKER,
        options={"url": url, "key_prefix": prefix, **opts},
        block_size=BS,
        fingerprint=fp,
    )
    worker = RedisWorker(context)
    caches = [torch.zeros(2, BLOCKS, BS, HEADS, DIM) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    return worker, caches


def ctx(caches: list[torch.Tensor], step: int = 1) -> ForwardContext:
    return ForwardContext(step_id=step, rank=0, kv_caches=caches, scheduler_output=None)


async def save(worker: RedisWorker, caches, saves: list[BlockTransfer]) -> frozenset[str]:
    worker.bind_connector_metadata(RedisMetadata.build(1, [], saves))
    await worker.start_load_kv(ctx(caches))
    for layer, kv in enumerate(caches):
        worker.save_kv_layer(layer, kv, ctx(caches))
    failed = await worker.wait_for_save()
    worker.clear_connector_metadata()
    return failed


async def load(worker: RedisWorker, caches, loads: list[BlockTransfer]) -> frozenset[int]:
    worker.bind_connector_metadata(RedisMetadata.build(2, loads, []))
    await worker.start_load_kv(ctx(caches, 2))
    for layer in range(len(caches)):
        worker.wait_for_layer_load(layer)
    await worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def prefix() -> str:
    return f"worker-{uuid.uuid4().hex[:8]}:"


@pytest.mark.anyio
class TestRedisWorker:
    async def test_save_then_load_round_trips_every_layer(self, redis_url, prefix):
        """Blocks 1 and 2 saved by one worker land bit-exact in blocks 5 and 6 of
        another's cache, every layer; stats count them."""
        writer, source = make(redis_url, prefix)
        for kv in source:
            kv.normal_()
        reader, target = make(redis_url, prefix)
        try:
            assert (
                await save(writer, source, [BlockTransfer("a", 1, H1), BlockTransfer("a", 2, H2)])
                == frozenset()
            )
            errors = await load(
                reader, target, [BlockTransfer("b", 5, H1), BlockTransfer("b", 6, H2)]
            )
            assert errors == frozenset()
            for src, dst in zip(source, target, strict=True):
                assert torch.equal(dst[:, 5], src[:, 1]) and torch.equal(dst[:, 6], src[:, 2])
            assert reader.stats.loaded_blocks == 2 and writer.stats.saved_blocks == 2
        finally:
            await writer.aclose()
            await reader.aclose()

    async def test_missing_value_is_a_load_error_and_writes_nothing(self, redis_url, prefix):
        """A block the store does not hold is reported; its cache block stays untouched."""
        reader, target = make(redis_url, prefix)
        try:
            assert await load(reader, target, [BlockTransfer("b", 3, H1)]) == {3}
            assert all(kv.count_nonzero() == 0 for kv in target)
        finally:
            await reader.aclose()

    async def test_dead_server_fails_saves_and_loads_without_raising(self, prefix):
        """Nothing listening: the save reports its request, the load its blocks."""
        worker, caches = make(dead_url(), prefix, load_timeout_s=0.5)
        try:
            assert await save(worker, caches, [BlockTransfer("a", 1, H1)]) == {"a"}
            assert await load(worker, caches, [BlockTransfer("b", 2, H1)]) == {2}
            assert worker.stats.failed_saves == 1 and worker.stats.load_errors == 1
        finally:
            await worker.aclose()

    async def test_a_late_reply_never_lands_after_the_deadline(
        self, redis_url, prefix, monkeypatch
    ):
        """Values that arrive after load_timeout_s are load errors, and the job copies
        nothing into the cache afterwards (the blocks are being recomputed)."""
        writer, source = make(redis_url, prefix)
        for kv in source:
            kv.fill_(1.0)
        reader, target = make(redis_url, prefix, load_timeout_s=0.2)
        real = RedisStore.get_many

        def late(self, keys):
            time.sleep(0.5)
            return real(self, keys)

        try:
            await save(writer, source, [BlockTransfer("a", 1, H1)])
            monkeypatch.setattr(RedisStore, "get_many", late)
            job_errors = await load(reader, target, [BlockTransfer("b", 4, H1)])
            assert job_errors == {4}
            time.sleep(0.6)  # the reply has arrived by now
            assert all(kv.count_nonzero() == 0 for kv in target)
        finally:
            await writer.aclose()
            await reader.aclose()
