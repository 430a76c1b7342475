"""OffloadWorker on raw tensors: copies, key checks, checksums, faults, layer overlap."""

from __future__ import annotations

import threading
from typing import NamedTuple

import anyio
import anyio.to_thread
import attrs
import pytest
import torch

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorRole,
    ModelFingerprint,
)
from connectors.lifecycle import GuardedWorker, make_worker
from connectors.offload import BlockCopy, OffloadMetadata, OffloadWorker
from pipeline.artifacts import SchedulerOutput
from pipeline.errors import InvalidConfigError

pytestmark = pytest.mark.anyio

LAYERS, NUM_BLOCKS, BS, HEADS, DIM = 3, 8, 4, 2, 8
FP = ModelFingerprint(architecture="Llama", weights_id="w", dtype="float32", block_size=BS)


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


def caches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, NUM_BLOCKS, BS, HEADS, DIM) for _ in range(LAYERS)]


def build(kv: list[torch.Tensor], fp: ModelFingerprint = FP, **options) -> GuardedWorker:
    context = ConnectorContext(
        role=KVConnectorRole.WORKER,
        options={"num_blocks": 4, **options},
        block_size=BS,
        fingerprint=fp,
    )
    worker = make_worker(OffloadWorker(context))
    assert isinstance(worker, GuardedWorker)
    worker.register_kv_caches(kv)
    return worker


def inner(worker: GuardedWorker) -> OffloadWorker:
    assert isinstance(worker.inner, OffloadWorker)
    return worker.inner


class Result(NamedTuple):
    failed_saves: frozenset[str]
    errors: frozenset[int]
    stats: tuple[int, int, int, int]
    recving: frozenset[str]


_steps = iter(range(1_000_000))


async def run_step(
    worker: GuardedWorker,
    kv: list[torch.Tensor],
    *,
    loads: tuple[BlockCopy, ...] = (),
    saves: tuple[BlockCopy, ...] = (),
    async_ids: frozenset[str] = frozenset(),
    finished: frozenset[str] = frozenset(),
) -> Result:
    """One worker step in the engine's order; the layer hooks run on a thread."""
    step_id = next(_steps)
    worker.begin_step(step_id)
    try:
        worker.bind_connector_metadata(
            OffloadMetadata.build(step_id, list(loads), list(saves), set(async_ids))
        )
        so = SchedulerOutput(step_id=step_id, finished_req_ids=finished)
        ctx = ForwardContext(step_id=step_id, rank=0, kv_caches=kv, scheduler_output=so)
        await worker.start_load_kv(ctx)

        def forward() -> None:
            for layer in range(LAYERS):
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer, kv[layer], ctx)

        await anyio.to_thread.run_sync(forward)
        failed = await worker.wait_for_save()
        done = await worker.get_finished(finished)
        return Result(
            failed, worker.get_block_ids_with_load_errors(), worker.get_kv_stats(), done.recving
        )
    finally:
        worker.clear_connector_metadata()


def block(kv: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([layer[:, block_id] for layer in kv])


SAVES = (BlockCopy("a", 1, 0, h(1)), BlockCopy("a", 2, 1, h(2)), BlockCopy("b", 5, 3, h(5)))


@pytest.fixture
async def saved():
    """A worker whose slots 0, 1, 3 hold blocks 1, 2, 5 of the original cache."""
    kv = caches()
    original = [block(kv, b) for b in range(NUM_BLOCKS)]
    worker = build(kv)
    result = await run_step(worker, kv, saves=SAVES)
    assert result.failed_saves == frozenset() and result.stats[2] == 3 * BS
    yield worker, kv, original
    await worker.aclose()


class TestRoundTrip:
    async def test_saved_blocks_load_back_bit_exact(self, saved):
        """Blocks saved into slots load into other blocks unchanged, every layer."""
        worker, kv, original = saved
        for layer in kv:
            layer.zero_()
        loads = (BlockCopy("c", 6, 0, h(1)), BlockCopy("c", 7, 1, h(2)), BlockCopy("c", 0, 3, h(5)))
        result = await run_step(worker, kv, loads=loads)
        assert result.errors == frozenset()
        for dst, src in ((6, 1), (7, 2), (0, 5)):
            assert torch.equal(block(kv, dst), original[src])
        pool_bytes = inner(worker).pool.block_bytes
        assert result.stats[:2] == (3 * BS, 3 * pool_bytes)
        assert inner(worker).stats.loaded_blocks == 3

    async def test_key_mismatch_is_a_load_error_and_writes_nothing(self, saved):
        """A slot whose recorded key differs (overwritten by hand) is reported, and the
        block keeps its old content instead of receiving wrong data."""
        worker, kv, original = saved
        pool = inner(worker).pool
        pool.keys[1] = inner(worker).key_prefix + h(99)
        pool.layers[0][1].normal_()
        before = block(kv, 7).clone()
        loads = (BlockCopy("c", 6, 0, h(1)), BlockCopy("c", 7, 1, h(2)))
        result = await run_step(worker, kv, loads=loads, saves=(BlockCopy("c", 3, 2, h(9)),))
        assert result.errors == {7}
        assert torch.equal(block(kv, 7), before) and torch.equal(block(kv, 6), original[1])
        assert result.failed_saves == {"c"}  # its new KV was computed on a bad block
        assert pool.keys[2] is None

    async def test_another_fingerprint_never_loads(self, saved):
        """Slots written under one model's fingerprint are load errors for another."""
        worker, kv, _ = saved
        other = build(kv, attrs.evolve(FP, tp_rank=1, tp_size=2))
        try:
            mine, theirs = inner(worker).pool, inner(other).pool
            theirs.keys[:] = mine.keys
            for src, dst in zip(mine.layers, theirs.layers, strict=True):
                dst.copy_(src)
            result = await run_step(other, kv, loads=(BlockCopy("c", 6, 0, h(1)),))
            assert result.errors == {6}
        finally:
            await other.aclose()


class TestChecksums:
    async def test_corrupt_bytes_under_the_right_key_are_a_load_error(self):
        """With verify_checksum, a flipped value in one layer's slot fails that block."""
        kv = caches()
        worker = build(kv, verify_checksum=True)
        try:
            await run_step(worker, kv, saves=SAVES)
            inner(worker).pool.layers[2][1, 0, 0, 0, 0] += 1.0
            loads = (BlockCopy("c", 6, 0, h(1)), BlockCopy("c", 7, 1, h(2)))
            result = await run_step(worker, kv, loads=loads)
            assert result.errors == {7}
            assert torch.equal(block(kv, 6), block(caches(), 1))
        finally:
            await worker.aclose()


class TestFaults:
    async def test_a_save_copy_that_raises_fails_its_requests_only(self, monkeypatch):
        """An exception in one run's copy fails that run's request, not the step; its
        slot stays unloadable."""
        kv = caches()
        worker = build(kv)
        pool = inner(worker).pool
        real = pool.save_layer

        def flaky(layer, kv_layer, runs):
            if runs[0].block == 5:
                raise RuntimeError("injected save fault")
            real(layer, kv_layer, runs)

        monkeypatch.setattr(pool, "save_layer", flaky)
        try:
            result = await run_step(worker, kv, saves=SAVES)
            assert result.failed_saves == {"b"} and result.stats[2] == 2 * BS
            assert pool.keys[3] is None and pool.keys[0] is not None
            later = await run_step(worker, kv, loads=(BlockCopy("c", 6, 3, h(5)),))
            assert later.errors == {6}
        finally:
            await worker.aclose()

    async def test_a_load_copy_that_raises_is_a_load_error(self, saved, monkeypatch):
        """A load copy that raises marks its blocks failed; the forward never hangs."""
        worker, kv, _ = saved

        def broken(layer, kv_layer, runs):
            raise RuntimeError("injected load fault")

        monkeypatch.setattr(inner(worker).pool, "load_layer", broken)
        result = await run_step(
            worker, kv, loads=(BlockCopy("c", 6, 0, h(1)),), saves=(BlockCopy("c", 7, 2, h(8)),)
        )
        assert result.errors == {6} and result.failed_saves == {"c"}

    async def test_register_refuses_a_wrong_block_bytes(self):
        """block_bytes that does not match the cache is refused, naming the real size."""
        context = ConnectorContext(
            role=KVConnectorRole.WORKER,
            options={"num_blocks": 2, "block_bytes": 12345},
            block_size=BS,
            fingerprint=FP,
        )
        worker = OffloadWorker(context)
        with pytest.raises(InvalidConfigError, match="block_bytes"):
            worker.register_kv_caches(caches())
        await worker.aclose()


def gate_layers(
    worker: GuardedWorker, release: threading.Event, entered: threading.Event | None = None
) -> list[int]:
    """Make every layer from 1 on wait for ``release`` before it copies (``entered`` is
    set when layer 1 starts); returns the list of layers copied, in order."""
    loader = inner(worker)._loader
    real = loader.load_layer
    finished: list[int] = []

    def slow(layer, kv_layer, job):
        if layer >= 1:
            if entered is not None:
                entered.set()
            release.wait(10)
        real(layer, kv_layer, job)
        finished.append(layer)

    loader.load_layer = slow
    return finished


class TestLayerwise:
    async def test_layer_zero_is_ready_before_the_last_layer_lands(self, saved):
        """wait_for_layer_load(0) returns while later layers are still loading."""
        worker, kv, original = saved
        release = threading.Event()
        finished = gate_layers(worker, release)
        worker.begin_step(1000)
        worker.bind_connector_metadata(
            OffloadMetadata.build(1000, [BlockCopy("c", 6, 0, h(1))], [], set())
        )
        so = SchedulerOutput(step_id=1000)
        await worker.start_load_kv(
            ForwardContext(step_id=1000, rank=0, kv_caches=kv, scheduler_output=so)
        )
        await anyio.to_thread.run_sync(worker.wait_for_layer_load, 0)
        assert finished == [0] and torch.equal(kv[0][:, 6], original[1][0])
        release.set()
        for layer in range(1, LAYERS):
            await anyio.to_thread.run_sync(worker.wait_for_layer_load, layer)
        assert finished == [0, 1, 2] and torch.equal(block(kv, 6), original[1])
        await worker.wait_for_save()
        await worker.get_finished(frozenset())
        worker.clear_connector_metadata()

    async def test_a_failed_step_cancels_its_loads_before_the_next_step(self, saved):
        """A step cleared mid-load (it failed) stops at the next layer; the next step
        starts only after that load has stopped, so nothing stale lands later."""
        worker, kv, _ = saved
        release, entered = threading.Event(), threading.Event()
        finished = gate_layers(worker, release, entered)
        worker.begin_step(2000)
        worker.bind_connector_metadata(
            OffloadMetadata.build(2000, [BlockCopy("c", 6, 0, h(1))], [], set())
        )
        so = SchedulerOutput(step_id=2000)
        await worker.start_load_kv(
            ForwardContext(step_id=2000, rank=0, kv_caches=kv, scheduler_output=so)
        )
        await anyio.to_thread.run_sync(entered.wait, 10)
        worker.clear_connector_metadata()  # the step failed while layer 1 was loading
        threading.Timer(0.05, release.set).start()
        result = await run_step(worker, kv)
        assert finished == [0, 1] and result.errors == frozenset()  # layer 2 never ran


class TestAsyncLoads:
    async def test_async_load_is_reported_received_once_done(self):
        """An async load completes across steps and is reported in recving once."""
        kv = caches()
        worker = build(kv, async_load=True)
        try:
            await run_step(worker, kv, saves=SAVES)
            release = threading.Event()
            inner(worker)._async_loader.load_layer = _gated(inner(worker)._async_loader, release)
            first = await run_step(
                worker, kv, loads=(BlockCopy("c", 6, 0, h(1)),), async_ids=frozenset({"c"})
            )
            assert first.recving == frozenset()
            release.set()
            for _ in range(100):
                later = await run_step(worker, kv)
                if later.recving:
                    break
                await anyio.sleep(0.01)
            assert later.recving == {"c"} and later.stats[0] == BS
            assert (await run_step(worker, kv)).recving == frozenset()
        finally:
            await worker.aclose()

    async def test_aborted_async_load_is_cancelled_before_the_next_forward(self):
        """A request that ended while loading is cancelled and never reported."""
        kv = caches()
        worker = build(kv, async_load=True)
        try:
            await run_step(worker, kv, saves=SAVES)
            release = threading.Event()
            inner(worker)._async_loader.load_layer = _gated(inner(worker)._async_loader, release)
            await run_step(
                worker, kv, loads=(BlockCopy("c", 6, 0, h(1)),), async_ids=frozenset({"c"})
            )
            threading.Timer(0.05, release.set).start()
            result = await run_step(worker, kv, finished=frozenset({"c"}))
            assert result.recving == frozenset() and inner(worker)._async_jobs == {}
        finally:
            await worker.aclose()


def _gated(loader, release: threading.Event):
    real = loader.load_layer

    def slow(layer, kv_layer, job):
        release.wait(10)
        real(layer, kv_layer, job)

    return slow


class TestClose:
    async def test_aclose_joins_the_loader_threads_and_is_idempotent(self, saved):
        """aclose stops the loader threads; a second call is a no-op."""
        worker, kv, _ = saved
        await run_step(worker, kv, loads=(BlockCopy("c", 6, 0, h(1)),))
        thread = inner(worker)._loader._thread
        assert thread.is_alive()
        await worker.aclose()
        await worker.aclose()
        assert not thread.is_alive() and inner(worker).pool is None
