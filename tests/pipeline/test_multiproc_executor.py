"""The ``multiproc`` executor: a worker process per rank, tensor-parallel over gloo.

Greedy outputs at world_size 2 equal world_size 1 (Llama with GQA, Qwen2 with qkv bias
and tied embeddings), with and without the shared_storage connector; a SIGKILLed worker
ends every in-flight request with ``EngineDeadError`` within the fan-in deadline; and
every byte between the engine and its workers is a msgspec wire message.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import time
from pathlib import Path
from typing import ClassVar

import anyio
import attrs
import msgspec
import pytest

from pipeline import (
    LLM,
    AsyncEngine,
    EngineConfig,
    ModelOutput,
    SamplingParams,
    StepContext,
    StepGraph,
)
from pipeline.errors import EngineDeadError, InvalidConfigError, WorkerFailedError
from pipeline.executors import wire
from pipeline.executors.channel import Channel

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 30.0


def workload() -> list[list[int]]:
    """Shared prefixes across blocks, a partial hit, an unrelated prompt, chunked prefill."""
    rng = random.Random(5)
    base = [rng.randrange(1, 256) for _ in range(48)]
    return [
        [*base, *[rng.randrange(1, 256) for _ in range(5)]],
        [*base, *[rng.randrange(1, 256) for _ in range(27)]],
        [*base[:32], *[rng.randrange(1, 256) for _ in range(12)]],
        [rng.randrange(1, 256) for _ in range(37)],
        [rng.randrange(1, 256) for _ in range(3)],
    ]


def config(model: Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = dict(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        fan_in_timeout_s=TIMEOUT_S,
    )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def generate(cfg: EngineConfig) -> tuple[list[tuple[int, ...]], list[int]]:
    with LLM(cfg) as llm:
        outs = llm.generate(workload(), PARAMS)
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest, tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def reference_llama(llama_path: Path) -> list[tuple[int, ...]]:
    """world_size 1, in-process, no connector, on the Llama checkpoint."""
    return generate(config(llama_path))[0]


@pytest.fixture(scope="module")
def reference(model: Path) -> list[tuple[int, ...]]:
    """world_size 1, in-process, no connector."""
    return generate(config(model))[0]


class TestTensorParallelOutputs:
    def test_world_size_2_equals_world_size_1(self, model: Path, reference) -> None:
        """Two tensor-parallel worker processes give the single rank's greedy tokens."""
        tokens, _ = generate(config(model, executor="multiproc", world_size=2))
        assert tokens == reference

    @pytest.mark.timeout(180)
    def test_more_ranks_than_kv_heads(self, model: Path, reference) -> None:
        """Four ranks over two KV heads (each held by two ranks) give the same tokens."""
        tokens, _ = generate(config(model, executor="multiproc", world_size=4))
        assert tokens == reference

    def test_gloo_alone_when_no_filesystem_has_room(
        self, model: Path, reference, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without room for the shared-memory all-reduce file (a full /dev/shm would
        kill the workers with SIGBUS), the ranks reduce with gloo: same tokens."""
        import os as os_module

        from pipeline.executors import remote

        real = os_module.statvfs

        class Full:
            def __init__(self, path: str) -> None:
                stat = real(path)
                self.f_frsize, self.f_bavail = stat.f_frsize, 0

        monkeypatch.setattr(remote.os, "statvfs", Full)
        cfg = config(model, executor="multiproc", world_size=2)
        workdir, path, slot = remote.plan_workdir(cfg, "gloo")
        os_module.rmdir(workdir)
        assert (path, slot) == (None, 0)
        tokens, _ = generate(cfg)
        assert tokens == reference

    def test_shared_storage_saves_then_loads_shards(
        self, model: Path, reference, tmp_path: Path
    ) -> None:
        """With shared_storage, each rank saves its own shard; a second engine loads them
        (full blocks of every prompt) and the tokens stay the single rank's."""
        cfg = config(
            model,
            executor="multiproc",
            world_size=2,
            connector="shared_storage",
            connector_options={"path": str(tmp_path / "store")},
        )
        first, _ = generate(cfg)
        assert first == reference
        second, cached = generate(cfg)
        assert second == reference
        full = [(len(p) - 1) // 16 * 16 for p in workload()]
        assert cached == full
        # One value directory per rank: the keys carry the TP rank and the shard layout.
        fingerprints = {p.parent.parent.name for p in (tmp_path / "store").rglob("*.kv")}
        assert len(fingerprints) == 2

    def test_step_log_has_every_ranks_records(self, llama_path: Path, tmp_path: Path) -> None:
        """Workers' step records reach the engine's step log, one per rank per step."""
        log = tmp_path / "steps.jsonl"
        generate(config(llama_path, executor="multiproc", world_size=2, step_log=str(log)))
        records = [msgspec.json.decode(line) for line in log.read_text().splitlines()]
        steps = [r for r in records if r.get("event") == "step"]
        engine_steps = {r["step_id"] for r in steps if r.get("kind") == "engine"}
        for rank in (0, 1):
            ranks = {r["step_id"] for r in steps if r.get("kind") == "worker" and r["rank"] == rank}
            assert ranks == engine_steps


class TestWorkerDeath:
    @pytest.mark.timeout(120)
    @pytest.mark.anyio
    async def test_sigkill_ends_every_request_with_engine_dead(self, llama_path: Path) -> None:
        """SIGKILL of one worker mid-generation: every in-flight generate raises
        EngineDeadError naming the rank, well within the fan-in deadline; new requests
        are refused; no worker process is left behind."""
        cfg = config(llama_path, executor="multiproc", world_size=2, max_num_batched_tokens=256)
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(cfg) as engine:
            pids = engine.core.executor.pids  # type: ignore[attr-defined]
            errors: list[BaseException] = []
            started = anyio.Event()
            progressed = [0]

            async def consume(prompt: list[int]) -> None:
                try:
                    async for out in engine.generate(prompt, params):
                        progressed[0] += len(out.new_token_ids)
                        if progressed[0] >= 8:
                            started.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for prompt in workload():
                        tg.start_soon(consume, prompt)
                    await started.wait()
                    os.kill(pids[1], signal.SIGKILL)
                    killed = time.monotonic()
            elapsed = time.monotonic() - killed
            assert len(errors) == len(workload())
            assert elapsed < TIMEOUT_S / 2
            assert all("rank 1" in str(e) for e in errors)
            with pytest.raises(EngineDeadError):
                engine.generate([1, 2, 3], params)
        for pid in pids:  # closing the dead engine reaped every worker
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


class TestEventLoops:
    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["trio"])
    async def test_streams_under_trio(self, llama_path: Path, anyio_backend: str) -> None:
        """The multiproc executor's socket waits work under trio as under asyncio."""
        expected = generate(config(llama_path))[0]
        async with AsyncEngine(config(llama_path, executor="multiproc", world_size=2)) as engine:
            got = []
            for prompt in workload()[:2]:
                outs = [out async for out in engine.generate(prompt, PARAMS)]
                got.append(outs[-1].token_ids)
        assert got == expected[:2]

    @pytest.mark.timeout(60)
    @pytest.mark.anyio
    async def test_a_worker_dying_while_idle_is_noticed(self, llama_path: Path) -> None:
        """A worker killed while no step runs: the idle loop's liveness poll ends the
        engine, and the next generate raises EngineDeadError at once."""
        async with AsyncEngine(config(llama_path, executor="multiproc", world_size=2)) as engine:
            pids = engine.core.executor.pids  # type: ignore[attr-defined]
            os.kill(pids[0], signal.SIGKILL)
            await anyio.sleep(1.0)  # the idle loop polls the workers every 50 ms
            with pytest.raises(EngineDeadError) as dead:
                engine.generate([1, 2, 3], PARAMS)
            assert "rank 0" in str(dead.value)


class TestNoPickle:
    def test_wire_refuses_what_is_not_a_message(self) -> None:
        """The transport refuses a non-message, a message holding an arbitrary object,
        and pickled bytes."""
        with pytest.raises(wire.TransportError, match="only the wire messages"):
            wire.encode({"step": 1})  # type: ignore[arg-type]
        with pytest.raises(wire.TransportError, match="never pickles"):
            wire.encode(wire.StepDone(output=object(), records=[]))  # type: ignore[arg-type]
        with pytest.raises(wire.TransportError, match="undecodable"):
            wire.decode(pickle.dumps(wire.Shutdown()))

    @pytest.mark.anyio
    async def test_channel_refuses_a_corrupt_frame(self) -> None:
        """A frame whose body is not a wire message fails the read with TransportError."""
        import socket

        a, b = socket.socketpair()
        left, right = Channel(a, peer="left"), Channel(b, peer="right")
        try:
            body = pickle.dumps({"x": 1})
            b_raw = len(body).to_bytes(8, "little") + body
            a.sendall(b_raw)
            with pytest.raises(wire.TransportError):
                await right.recv()
        finally:
            left.close()
            right.close()

    def test_every_frame_of_a_generation_is_msgpack(
        self, llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every frame the engine sends to or reads from a worker during a generation
        with a connector decodes strictly as a wire message, and pickle is never called
        in the engine's process meanwhile."""
        sent: list[bytes] = []
        received: list[bytes] = []
        frame, decode = Channel._frame, wire.decode

        def tap_frame(self: Channel, message: wire.Message | bytes) -> bytes:
            data = frame(self, message)
            sent.append(data[8:])
            return data

        def tap_decode(data: bytes | memoryview) -> wire.Message:
            received.append(bytes(data))
            return decode(data)

        def forbidden(*args: object, **kwargs: object) -> None:
            raise AssertionError("pickle was used across the engine/worker boundary")

        cfg = config(
            llama_path,
            executor="multiproc",
            world_size=2,
            connector="shared_storage",
            connector_options={"path": str(tmp_path / "store")},
        )
        monkeypatch.setattr(Channel, "_frame", tap_frame)
        monkeypatch.setattr(wire, "decode", tap_decode)
        for name in ("dumps", "loads", "dump", "load"):
            monkeypatch.setattr(pickle, name, forbidden)
        generate(cfg)
        kinds = {type(msgspec.msgpack.decode(b, type=wire.Message)) for b in sent + received}
        assert {wire.Init, wire.Step, wire.Shutdown} <= kinds
        assert {wire.Ready, wire.StepDone} <= kinds
        steps = [msgspec.msgpack.decode(b, type=wire.Message) for b in sent]
        assert any(isinstance(s, wire.Step) and s.metadata is not None for s in steps)


@attrs.frozen
class RowsSeen:
    rows: int


@attrs.frozen
class CountRows:
    """A user stage, defined at module level so that worker processes can import it."""

    name: ClassVar[str] = "count_rows"
    requires: ClassVar[tuple[type, ...]] = (ModelOutput,)
    provides: ClassVar[type] = RowsSeen

    async def run(self, ctx: StepContext) -> RowsSeen:
        return RowsSeen(len(ctx.get(ModelOutput).req_ids))


def with_count_rows(graph: StepGraph) -> StepGraph:
    return graph.insert_after("forward", CountRows())


class TestUserCode:
    def test_a_custom_stage_and_connector_reach_every_worker(
        self, llama_path: Path, tmp_path: Path, reference_llama
    ) -> None:
        """A module-level graph function and a connector registered under a new name in
        the engine's process are rebuilt in each worker from their import paths (a
        worker that could not would fail to start: the name is not a built-in): the
        stage runs on both ranks, and the step metadata the scheduler half builds
        reaches them."""
        from connectors.registry import register_connector, unregister_connector
        from connectors.testing import RecordingConnector

        RecordingConnector.reset()
        register_connector(
            "user-recording", RecordingConnector.Scheduler, RecordingConnector.Worker
        )
        log = tmp_path / "steps.jsonl"
        try:
            with LLM(
                config(
                    llama_path,
                    executor="multiproc",
                    world_size=2,
                    connector="user-recording",
                    step_log=str(log),
                ),
                worker_graph=with_count_rows,
            ) as llm:
                tokens = [o.token_ids for o in llm.generate(workload(), PARAMS)]
        finally:
            unregister_connector("user-recording")
        assert tokens == reference_llama
        records = [msgspec.json.decode(line) for line in log.read_text().splitlines()]
        ranks = {r["rank"] for r in records if r.get("stage") == "count_rows"}
        assert ranks == {0, 1}
        built = [c for c in RecordingConnector.calls if c.method == "build_connector_meta"]
        assert built and all(c.role == "scheduler" for c in built)


class TestConfiguration:
    def test_a_lambda_worker_graph_is_refused(self, llama_path: Path) -> None:
        """A worker graph that cannot be imported by a worker process is a typed error."""
        with pytest.raises(InvalidConfigError, match="worker_graph"):
            LLM(config(llama_path, executor="multiproc", world_size=2), worker_graph=lambda g: g)

    def test_heads_not_divisible_by_world_size(self, llama_path: Path) -> None:
        """world_size 3 does not split 4 heads: refused before any process starts."""
        with pytest.raises(InvalidConfigError, match="world_size"):
            LLM(config(llama_path, executor="multiproc", world_size=3))

    def test_a_rank_that_fails_to_start_names_itself(
        self, llama_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A connector the worker half cannot build fails the start with the rank's
        error, and no worker process is left."""
        import subprocess

        from pipeline.executors import multiproc

        started: list[subprocess.Popen[bytes]] = []
        real_popen = subprocess.Popen

        def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
            proc = real_popen(*args, **kwargs)  # type: ignore[call-overload]
            started.append(proc)
            return proc

        monkeypatch.setattr(multiproc.subprocess, "Popen", popen)
        cfg = config(
            llama_path,
            executor="multiproc",
            world_size=2,
            connector="faulty",
            connector_options={"inner": "no-such-connector"},
        )
        with pytest.raises(WorkerFailedError, match="rank 0 failed: failed to start: Unknown"):
            LLM(cfg)
        assert len(started) == 2
        assert all(proc.poll() is not None for proc in started)


def faulty(model: Path, store: Path, fault: dict[str, object]) -> EngineConfig:
    return config(
        model,
        executor="multiproc",
        world_size=2,
        connector="faulty",
        connector_options={
            "inner": "shared_storage",
            "inner_options": {"path": str(store)},
            "faults": [fault],
        },
    )


class TestFaultsAcrossProcesses:
    def test_a_fault_after_the_forward_fails_only_its_step(
        self, llama_path: Path, tmp_path: Path
    ) -> None:
        """get_block_ids_with_load_errors raising on rank 1 (after the collectives; a
        load-side call): that step's requests end with "error", the group stays in step
        and the engine keeps serving. (This test used wait_for_save, which since issue 30
        is a save-side call that costs caching only: see the next test.)"""
        fault = {"call": "get_block_ids_with_load_errors", "action": "raise", "step": 1, "rank": 1}
        cfg = faulty(llama_path, tmp_path, fault)
        expected = generate(config(llama_path))[0]
        with LLM(cfg) as llm:
            outs = llm.generate(workload(), PARAMS)
            failed = [o for o in outs if o.finish_reason == "error"]
            assert failed and all(o.failure is not None for o in failed)
            assert all(1 in o.failure.ranks for o in failed)  # type: ignore[union-attr]
            again = llm.generate(workload(), PARAMS)
        assert [o.token_ids for o in again] == expected

    def test_a_save_fault_on_one_rank_fails_no_request(
        self, llama_path: Path, tmp_path: Path
    ) -> None:
        """wait_for_save raising on rank 1 (issue 30): every request keeps the tokens of
        an engine without faults; the engine keeps serving."""
        cfg = faulty(
            llama_path, tmp_path, {"call": "wait_for_save", "action": "raise", "step": 1, "rank": 1}
        )
        expected = generate(config(llama_path))[0]
        with LLM(cfg) as llm:
            outs = llm.generate(workload(), PARAMS)
            assert all(o.finish_reason == "length" for o in outs), outs
            again = llm.generate(workload(), PARAMS)
        assert [o.token_ids for o in outs] == expected
        assert [o.token_ids for o in again] == expected

    @pytest.mark.timeout(120)
    def test_a_fault_before_the_forward_kills_the_engine(
        self, llama_path: Path, tmp_path: Path
    ) -> None:
        """bind raising on rank 1 leaves rank 0 alone in a collective: the group can no
        longer run in step, so the engine dies with EngineDeadError instead of pairing
        the next step's collectives with the wrong tensors."""
        cfg = faulty(
            llama_path,
            tmp_path,
            {"call": "bind_connector_metadata", "action": "raise", "step": 1, "rank": 1},
        )
        with LLM(cfg) as llm:
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="rank 1"):
                llm.generate(workload(), PARAMS)
            assert time.monotonic() - start < TIMEOUT_S / 2

    @pytest.mark.timeout(120)
    def test_a_rank_past_the_deadline_fails_its_step_and_is_resynchronised(
        self, llama_path: Path, tmp_path: Path
    ) -> None:
        """wait_for_save hanging on rank 1 past a 2 s fan-in deadline: that step's
        requests fail naming the deadline, the late reply is dropped when it arrives, and
        the next generation on the same engine gives the single rank's tokens."""
        cfg = faulty(
            llama_path,
            tmp_path,
            {"call": "wait_for_save", "action": "hang", "hang_s": 4.0, "step": 1, "rank": 1},
        )
        cfg = EngineConfig(**{**attrs.asdict(cfg, recurse=False), "fan_in_timeout_s": 2.0})
        expected = generate(config(llama_path))[0]
        with LLM(cfg) as llm:
            outs = llm.generate(workload(), PARAMS)
            failed = [o for o in outs if o.finish_reason == "error"]
            assert failed
            assert all("deadline" in str(o.failure) for o in failed)
            again = llm.generate(workload(), PARAMS)
        assert [o.token_ids for o in again] == expected
