"""Failure semantics of the nixl connector (issue 13), each with a real fault: a producer
process SIGKILLed with a read in flight, a consumer process killed after its read,
repeated, late, early and unknown notifications, a producer of another layout, and a
producer that never answers its handshake. Every failure ends in a recompute or a failed
request (``load_failure_policy``), never in a leak, a hang or wrong tokens."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread
import attrs
import pytest

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")

from nixl_peer import SHAPE, TEST_KEY, filled_cache
from nixl_tickets import signed

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.nixl import NixlMetadata, NixlWorker, RemoteRead, peers
from connectors.nixl.agent import notification
from connectors.nixl.errors import HandshakeError
from connectors.nixl.metadata import HeldSend
from connectors.nixl.peers import PeerHandshakes, Resolved
from connectors.nixl.sends import HeldSends
from pipeline import LLM, AsyncEngine, EngineConfig, RequestOutput, SamplingParams

HERE = Path(__file__).parent
# The subprocesses import torch: slow on a loaded machine, never a hang.
START_S = 120.0
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


# As in test_nixl_engine.py (not imported: mypy would check that module too).
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 200) for _ in range(n)] for n in (40, 17, 33, 5)]


def config(role: str, *, policy: str = "recompute", **options: Any) -> EngineConfig:
    return EngineConfig(
        model="builtin:tiny",
        connector="nixl",
        connector_options={"role": role, "host": "127.0.0.1", **options},
        load_failure_policy=policy,
    )


def prefill(producer: LLM, batch: list[list[int]]) -> list[dict[str, Any]]:
    decode = [{"do_remote_decode": True}] * len(batch)
    outs = producer.generate(batch, PREFILL, kv_transfer_params=decode)
    params = [o.kv_transfer_params for o in outs]
    assert all(p is not None and p["do_remote_prefill"] for p in params), params
    return params  # type: ignore[return-value]


def wait_idle(llm: LLM, timeout: float = 10.0) -> dict[str, int]:
    end = time.monotonic() + timeout
    while any(llm.leak_report().values()) and time.monotonic() < end:
        time.sleep(0.02)
    return llm.leak_report()


class Script:
    """A helper script in its own process: JSON lines in, prefixed lines out."""

    def __init__(self, name: str, *args: object) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / name), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def send(self, obj: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str) -> str:
        """The rest of the next line starting with ``prefix`` (NIXL logs to stdout)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the helper exited ({self.proc.wait()}) before {prefix!r}"
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    async def aexpect(self, prefix: str) -> str:
        with anyio.fail_after(START_S):
            return await anyio.to_thread.run_sync(self.expect, prefix, abandon_on_cancel=True)

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP the helper and return once every thread of it is stopped: a signal
        is delivered asynchronously, and a READ posted right after ``kill()`` could
        still be served by a progress thread not stopped yet."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            states = []
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            if states and all(state in ("T", "t") for state in states):
                return
            time.sleep(0.001)
        raise AssertionError("the producer helper did not stop within 10 s")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], list[tuple[int, ...]]]:
    """One engine's greedy tokens per (dtype, block size) the consumers below use."""
    out = {}
    for dtype, block_size in (("float32", 16), ("float32", 8), ("bfloat16", 16)):
        cfg = EngineConfig(model="builtin:tiny", dtype=dtype, block_size=block_size)
        with LLM(cfg) as llm:
            out[dtype, block_size] = [o.token_ids for o in llm.generate(prompts(), PARAMS)]
    return out


async def run(engine: AsyncEngine, prompt: list[int], rid: str, **kw: Any) -> RequestOutput:
    last = None
    async for out in engine.generate(prompt, PARAMS, request_id=rid, **kw):
        last = out
    assert last is not None and last.finished
    return last


async def until_idle(engine: AsyncEngine, timeout: float = 20.0) -> dict[str, int]:
    with anyio.move_on_after(timeout):
        while any(engine.leak_report().values()):
            await anyio.sleep(0.01)
    return engine.leak_report()


def nixl_worker(engine: AsyncEngine) -> NixlWorker:
    inner = engine.core.workers[0].connector.inner  # type: ignore[union-attr]
    assert isinstance(inner, NixlWorker)
    return inner


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == "kvstep"]
    return [m for m in messages if event in m]


class TestProducerKilled:
    @pytest.mark.anyio
    async def test_a_read_in_flight_from_a_killed_producer_recomputes_or_fails(
        self, references: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Three consumers each read a held prefill from one producer process, which is
        stopped (SIGSTOP) with the READs in flight. The third (read_timeout_s=1) gives
        up on the hung producer by its deadline and recomputes. Then the producer is
        SIGKILLed with the other two READs still in flight: under recompute the request
        ends with one engine's tokens, under fail it alone ends with "error"; the other
        request of each batch completes; nothing leaks. Killed before the read starts:
        a fourth consumer, which still holds the dead producer as a peer, has its read
        refused and recomputes; a later request to the dead
        producer on the first, which forgot it, fails its handshake at once (port
        closed) and recomputes. (The fourth consumer's claim, sent before any read, now
        finds the dead producer's port closed.)

        UCX runs over TCP here (``UCX_TLS=tcp``, this process and the producer): a READ
        then needs the producer's CPU, so the stopped producer holds it in flight,
        deterministically. Over shared memory the consumer copies the pages itself: the
        read completes even from a stopped producer, in microseconds.
        """
        caplog.set_level(logging.INFO, logger="kvstep")
        monkeypatch.setenv("UCX_TLS", "tcp")
        reference = references["float32", 16]
        batch = prompts()
        producer = Script("nixl_producer.py", 60.0)
        try:
            cfgs = [
                config("consumer", policy=policy, port=free_port(), read_timeout_s=timeout)
                for policy, timeout in (
                    ("recompute", 30.0),
                    ("fail", 30.0),
                    ("recompute", 1.0),
                    ("recompute", 30.0),
                )
            ]
            async with (
                AsyncEngine(cfgs[0]) as recompute,
                AsyncEngine(cfgs[1]) as fail,
                AsyncEngine(cfgs[2]) as hung,
                AsyncEngine(cfgs[3]) as idle,
            ):
                engines = (recompute, fail, hung, idle)
                workers = [nixl_worker(e) for e in engines[:3]]
                await producer.aexpect("READY ")
                producer.send([batch[1]] * 4)  # warm-up: the read works, the peer is admitted
                warm = json.loads(await producer.aexpect("PARAMS "))
                for engine, params in zip(engines, warm, strict=True):
                    out = await run(engine, batch[1], "warm", kv_transfer_params=params)
                    assert out.token_ids == reference[1]
                    assert out.metrics is not None and out.metrics.num_external_tokens == 16
                producer.send([batch[0]] * 4)
                held = json.loads(await producer.aexpect("PARAMS "))
                # Each consumer claims its blocks from the producer before reading: stop
                # the producer once the three claims were granted, before any READ is
                # posted (the claims wait for each other on their poster threads).
                claimed = threading.Barrier(3, action=producer.stop)
                for worker in workers:

                    def claim_then_wait(spec: Any, claim: Any = worker._claim) -> None:
                        claim(spec)
                        if spec.req_id == "held":
                            claimed.wait(30)

                    worker._claim = claim_then_wait  # type: ignore[method-assign]
                ended: dict[tuple[int, str], tuple[RequestOutput, float]] = {}

                async def one(i: int, rid: str, prompt: list[int], params: Any = None) -> None:
                    out = await run(engines[i], prompt, rid, kv_transfer_params=params)
                    ended[i, rid] = (out, time.monotonic())

                def in_flight(i: int) -> bool:
                    read = workers[i]._reads.get("held")
                    agent = workers[i].agent
                    return read is not None and agent is not None and not agent.poll(read.handle)

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        for i in range(3):
                            tg.start_soon(one, i, "held", batch[0], held[i])
                        for i in range(2):
                            tg.start_soon(one, i, "local", batch[2])
                        # Each READ was posted (the producer was stopped before any);
                        # the 1-s reader may give up before a loaded machine posts the
                        # others, so each is seen once, not all three at one instant.
                        posted: set[int] = set()
                        while len(posted) < 3:
                            posted |= {i for i, w in enumerate(workers) if "held" in w._reads}
                            posted |= {i for i in range(3) if (i, "held") in ended}
                            await anyio.sleep(0.0005)
                        stopped = time.monotonic()
                        assert in_flight(0) and in_flight(1)
                        assert in_flight(2) or "held" not in workers[2]._reads
                        while (2, "held") not in ended:  # the hung producer's deadline
                            await anyio.sleep(0.001)
                        assert in_flight(0) and in_flight(1)  # still, at the kill
                        producer.signal(signal.SIGKILL)
                        killed, killed_at = time.monotonic(), time.time()
                        await anyio.to_thread.run_sync(producer.proc.wait)
                        reaped = time.monotonic()
                (redo, redo_t), (failed, failed_t) = ended[0, "held"], ended[1, "held"]
                assert redo.finish_reason == "length" and redo.token_ids == reference[0]
                assert failed.finish_reason == "error" and failed.token_ids == ()
                assert ended[2, "held"][0].token_ids == reference[0]
                assert [ended[i, "local"][0].token_ids for i in range(2)] == [reference[2]] * 2
                assert any("deadline" in m for m in logged(caplog, "nixl read failed"))
                seen = [  # when each consumer's poll found the READ failed (NIXL: ERR)
                    r.created - killed_at
                    for r in caplog.records
                    if "nixl read failed" in r.getMessage() and "ERR" in r.getMessage()
                ]
                assert len(seen) == 2
                print(
                    f"\nstopped producer -> request ended (read_timeout_s=1, recompute): "
                    f"{ended[2, 'held'][1] - stopped:.3f}s\n"
                    f"kill -> producer reaped: {reaped - killed:.3f}s; kill -> READ failed: "
                    f"{', '.join(f'{t:.3f}s' for t in seen)}; kill -> request ended: "
                    f"recompute {redo_t - killed:.3f}s (prompt recomputed, 6 tokens decoded), "
                    f"fail {failed_t - killed:.3f}s"
                )
                start = time.monotonic()  # the peer was forgotten: a new handshake
                with anyio.fail_after(60):
                    out = await run(recompute, batch[0], "again", kv_transfer_params=held[0])
                assert out.token_ids == reference[0]
                assert any("cannot connect" in m for m in logged(caplog, "handshake failed"))
                print(f"dead producer, handshake refused -> ended: {time.monotonic() - start:.3f}s")
                idle_agent = nixl_worker(idle).agent
                assert idle_agent is not None and idle_agent.has_peer(held[3]["remote_engine_id"])
                start = time.monotonic()
                with anyio.fail_after(60):
                    out = await run(idle, batch[0], "late", kv_transfer_params=held[3])
                assert out.token_ids == reference[0]
                # its claim finds the port closed before any READ is posted
                late = [m for m in logged(caplog, "nixl read failed") if "'late'" in m]
                assert late and all("cannot connect" in m for m in late)
                took = time.monotonic() - start
                print(f"dead peer still admitted, READ refused -> ended: {took:.3f}s")
                for engine in engines:
                    assert not any((await until_idle(engine)).values())
        finally:
            producer.close()


class TestConsumerKilled:
    def test_a_consumer_killed_before_notifying_leaves_the_blocks_to_the_lease(
        self, references: Any
    ) -> None:
        """A consumer process admits the producer, reads its blocks, and is SIGKILLed
        before it notifies: the producer keeps the blocks until the lease ends, then
        frees every one, and keeps serving."""
        consumer = Script("nixl_consumer.py")
        try:
            port = free_port()
            with LLM(config("producer", port=port, lease_s=5.0)) as producer:
                consumer.expect("READY")
                consumer.send({"host": "127.0.0.1", "port": port})
                consumer.expect("ADMITTED")
                (params,) = prefill(producer, prompts()[:1])  # the lease starts
                consumer.send(params)
                consumer.expect("READ")
                consumer.signal(signal.SIGKILL)
                consumer.proc.wait(10)
                assert producer.leak_report()["blocks_in_use"] == 3  # held, not notified
                assert not any(wait_idle(producer, 30.0).values())
                (out,) = producer.generate(prompts()[1:2], PARAMS)
                assert out.token_ids == references["float32", 16][1]
        finally:
            consumer.close()


class TestHeldSends:
    def test_a_repeated_notification_releases_once(self) -> None:
        """The second notification of a released send releases nothing."""
        sends = HeldSends(lease_s=10.0)
        sends.hold("a", 0.0)
        assert sends.take_released([("a", ""), ("a", "")], 1.0) == ["a"]
        assert sends.take_released([("a", "")], 2.0) == []
        assert len(sends) == 0

    def test_an_early_notification_releases_the_send_once_held(self) -> None:
        """The consumer read before this rank held the send: released when held."""
        sends = HeldSends(lease_s=10.0)
        assert sends.take_released([("a", "")], 0.0) == []
        sends.hold("a", 0.5)
        assert sends.take_released([], 1.0) == ["a"]

    def test_a_late_notification_never_releases_a_later_send_of_the_same_id(self) -> None:
        """A notification after the lease freed "a" is dropped: it must not free a
        new "a" (a reused request id) whose consumer may still be reading."""
        sends = HeldSends(lease_s=1.0)
        sends.hold("a", 0.0)
        assert sends.take_released([], 1.5) == ["a"]  # the lease ran out
        assert sends.take_released([("a", "")], 1.6) == []  # the late one
        sends.hold("a", 1.7)
        assert sends.take_released([], 1.8) == []  # still held
        assert sends.take_released([("a", "")], 1.9) == ["a"]  # its own notification

    def test_an_unknown_notification_is_forgotten_after_the_lease(self) -> None:
        """Nothing is released; the early entry goes after lease_s, so a send held
        later is not released by it."""
        sends = HeldSends(lease_s=1.0)
        assert sends.take_released([("ghost", "")], 0.0) == []
        assert sends.take_released([], 2.0) == []
        sends.hold("ghost", 2.0)
        assert sends.take_released([], 2.5) == []
        assert "ghost" in sends

    def test_a_notification_under_another_ticket_frees_nothing(self) -> None:
        """Audit H3: a notification naming a held request under a forged ticket (early
        or not) releases nothing; the request's own ticket does."""
        sends = HeldSends(lease_s=10.0)
        assert sends.take_released([("a", "forged")], 0.0) == []  # early, wrong
        sends.hold("a", 0.5, "good")
        assert sends.take_released([], 1.0) == []
        assert sends.take_released([("a", "forged")], 1.5) == []
        assert "a" in sends
        assert sends.take_released([("a", "good")], 2.0) == ["a"]

    def test_a_flood_of_notifications_is_capped(self) -> None:
        """Unknown ids cost bounded memory."""
        sends = HeldSends(lease_s=100.0)
        assert sends.take_released(((str(i), "") for i in range(20_000)), 0.0) == []
        assert len(sends._early) <= 4096


def nixl_worker_of(role: str, engine_id: str, **options: Any) -> NixlWorker:
    fingerprint = ModelFingerprint(
        architecture="A", weights_id="w", dtype="float32", block_size=SHAPE[2]
    )
    ctx = ConnectorContext(
        role=KVConnectorRole.WORKER,
        options={"role": role, "port": free_port(), "engine_id": engine_id, **options},
        block_size=SHAPE[2],
        fingerprint=fingerprint,
    )
    worker = NixlWorker(ctx)
    caches = filled_cache()
    worker.register_kv_caches(caches if role == "producer" else [t.zero_() for t in caches])
    return worker


async def step(worker: NixlWorker, meta: NixlMetadata) -> SimpleNamespace:
    """One step's connector calls; what it finished."""
    worker.bind_connector_metadata(meta)
    ctx = SimpleNamespace(scheduler_output=SimpleNamespace(requests=[object()]))
    await worker.start_load_kv(ctx)  # type: ignore[arg-type]
    finished = await worker.get_finished(frozenset())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return SimpleNamespace(sending=finished.sending, recving=finished.recving, errors=errors)


async def steps_until(worker: NixlWorker, meta: NixlMetadata, done: Any) -> list[SimpleNamespace]:
    """Steps (the first with ``meta``) until ``done(finished)``; every step's result."""
    out = []
    with anyio.fail_after(20):
        while True:
            out.append(await step(worker, meta))
            if done(out[-1]):
                return out
            meta = NixlMetadata()
            await anyio.sleep(0.001)


class TestNotifications:
    @pytest.mark.anyio
    async def test_early_repeated_and_unknown_notifications_free_a_send_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The consumer notifies before the producer holds the send (a read of no
        block: no claim), again, under a forged ticket, and names a request nobody
        holds: the producer releases the send exactly once, raises nothing, and holds
        nothing after. A read of a held send claims it first, then frees it."""
        caplog.set_level(logging.DEBUG, logger="kvstep")
        producer = nixl_worker_of("producer", "prod", lease_s=30.0)
        consumer = nixl_worker_of("consumer", "cons")
        try:
            opts = producer.options
            notify = RemoteRead("c1", "prod", opts.host, opts.port, "p1", (), (), "", "t1")
            await steps_until(consumer, NixlMetadata(reads=(notify,)), lambda f: True)
            assert consumer.agent is not None
            with anyio.fail_after(20):
                while not consumer.agent.has_peer("prod"):
                    await step(consumer, NixlMetadata())
            for name, ticket in (("p1", "t1"), ("p1", "forged"), ("nobody", "x")):
                consumer.agent.notify("prod", notification(name, ticket))
            early = await steps_until(  # they all arrive before the send is held
                producer, NixlMetadata(), lambda f: {"p1", "nobody"} <= set(producer.sends._early)
            )
            assert not any(f.sending for f in early)
            held = NixlMetadata(sends=(HeldSend("p1", "t1", (1, 2)),))
            released = await steps_until(producer, held, lambda f: f.sending)
            assert released[-1].sending == {"p1"}
            consumer.agent.notify("prod", notification("p1", "t1"))  # late
            later = await steps_until(
                producer, NixlMetadata(), lambda f: logged(caplog, "released send dropped")
            )
            assert not any(f.sending for f in later)
            assert len(producer.sends) == 0 and "p1" not in producer.sends._early
            await step(producer, NixlMetadata(sends=(HeldSend("p2", "t2", (1, 2)),)))
            read = RemoteRead("c2", "prod", opts.host, opts.port, "p2", (1, 2), (0, 3), "", "t2")
            done = await steps_until(consumer, NixlMetadata(reads=(read,)), lambda f: f.recving)
            assert done[-1].recving == {"c2"} and not done[-1].errors
            freed = await steps_until(producer, NixlMetadata(), lambda f: f.sending)
            assert freed[-1].sending == {"p2"} and len(producer.book) == 0
        finally:
            await consumer.aclose()
            await producer.aclose()


@pytest.fixture(scope="module")
def lapsing_producer() -> Iterator[LLM]:
    """A float32, block size 16 producer; its lease frees what nobody reads."""
    with LLM(config("producer", port=free_port(), lease_s=1.0)) as llm:
        yield llm
        assert not any(wait_idle(llm, 20.0).values())


class TestMismatch:
    def test_params_of_another_block_size_are_refused_and_the_prompt_recomputed(
        self, lapsing_producer: LLM, references: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The params name block size 16, the consumer's is 8: the read is refused
        before anyone is contacted and logged; under load_failure_policy="recompute"
        the request computes its prompt (vLLM would fail it; recompute is what the
        policy asks for) and ends with one engine's tokens."""
        caplog.set_level(logging.INFO, logger="kvstep")
        params = prefill(lapsing_producer, prompts()[:2])
        cfg = attrs.evolve(config("consumer", port=free_port()), block_size=8)
        with LLM(cfg) as consumer:
            outs = consumer.generate(prompts()[:2], PARAMS, kv_transfer_params=params)
            assert [o.token_ids for o in outs] == references["float32", 8][:2]
            assert not any(wait_idle(consumer).values())
        assert any("block_size" in m for m in logged(caplog, "remote prefill refused"))
        assert logged(caplog, "KV load failed")

    @pytest.mark.parametrize("policy", ["recompute", "fail"])
    def test_a_producer_of_another_dtype_is_refused_at_the_handshake(
        self, lapsing_producer: LLM, references: Any, caplog: pytest.LogCaptureFixture, policy: str
    ) -> None:
        """Params that claim the consumer's fingerprint (stale, or a lying proxy) from a
        float32 producer, read by a bfloat16 consumer: the handshake compares the
        producer's own info (its fingerprint, which holds the dtype, and the dtype
        itself), refuses it and logs it; the request recomputes or fails alone per
        load_failure_policy (as vLLM's handshake failure: the transfer fails)."""
        caplog.set_level(logging.INFO, logger="kvstep")
        cfg = attrs.evolve(config("consumer", policy=policy, port=free_port()), dtype="bfloat16")
        with LLM(cfg) as consumer:
            fingerprint = consumer.engine.core.fingerprint
            assert fingerprint is not None
            key = attrs.evolve(fingerprint, tp_rank=0).key()
            (params,) = prefill(lapsing_producer, prompts()[:1])
            # A producer holding the transfer key that lies about its model: its ticket
            # signs the lie (a client's edit of honest params is refused at the door).
            lying = signed({**params, "fingerprint": key}, prompts()[0])
            outs = consumer.generate(prompts()[:2], PARAMS, kv_transfer_params=[lying, None])
            reference = references["bfloat16", 16]
            if policy == "recompute":
                assert [o.token_ids for o in outs] == reference[:2]
            else:
                assert outs[0].finish_reason == "error"
                assert outs[1].token_ids == reference[1]
            assert not any(wait_idle(consumer).values())
        assert any("differs in dtype" in m for m in logged(caplog, "handshake failed"))


def waiting_read(req_id: str, engine_id: str, port: int) -> RemoteRead:
    return RemoteRead(req_id, engine_id, "127.0.0.1", port, "p", (0,), (0,))


class TestPeerHandshakes:
    def test_one_thread_per_peer_a_bound_on_peers_and_close_joins_them(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Reads of one peer share its handshake; past MAX_HANDSHAKES peers a read is
        refused at once; a dropped read is forgotten; close ends every thread."""
        monkeypatch.setattr(peers, "MAX_HANDSHAKES", 2)
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel, nothing is ever read
        port = silent.getsockname()[1]
        handshakes = PeerHandshakes(timeout_s=60.0, key=TEST_KEY, sender="cons")
        try:
            for req_id, engine_id in (("a", "e1"), ("b", "e1"), ("c", "e2")):
                handshakes.wait(waiting_read(req_id, engine_id, port), port)
            with pytest.raises(HandshakeError, match="in flight"):
                handshakes.wait(waiting_read("d", "e3", port), port)
            assert len(handshakes) == 3
            assert handshakes.drop("b") and not handshakes.drop("b")
            assert handshakes.take_resolved() == []  # nobody answers
            name = f"nixl-handshake-127.0.0.1:{port}"
            threads = [t for t in threading.enumerate() if t.name == name]
            assert len(threads) == 2
        finally:
            handshakes.close()
            silent.close()
        assert not any(t.is_alive() for t in threads)

    def test_a_closed_port_resolves_at_once_with_its_reads(self) -> None:
        """Nobody listens: the handshake ends (well before its 60 s timeout) with a
        HandshakeError and hands back the reads that waited for it."""
        handshakes = PeerHandshakes(timeout_s=60.0, key=TEST_KEY, sender="cons")
        port = free_port()
        try:
            handshakes.wait(waiting_read("a", "e", port), port)
            handshakes.wait(waiting_read("b", "e", port), port)
            resolved = anyio.run(until_resolved, handshakes)  # fails after 30 s
        finally:
            handshakes.close()
        (done,) = resolved
        assert done.info is None and isinstance(done.error, HandshakeError)
        assert "cannot connect" in str(done.error)
        assert [r.req_id for r in done.reads] == ["a", "b"]


async def until_resolved(handshakes: PeerHandshakes) -> list[Resolved]:
    with anyio.fail_after(30):
        while not (resolved := handshakes.take_resolved()):
            await anyio.sleep(0.005)
    return resolved


class TestHandshakeOffTheStep:
    @pytest.mark.anyio
    async def test_a_silent_producer_stalls_only_its_own_requests(self) -> None:
        """Two requests wait for a producer that accepts connections and never answers
        (handshake_timeout_s=60): one handshake runs for both, off the step, while a
        third request generates all its tokens; aborting the waiting ones frees
        everything, and closing the engine ends the handshake thread."""
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel, nothing is ever read
        try:
            cfg = config("consumer", port=free_port(), handshake_timeout_s=60.0)
            async with AsyncEngine(cfg) as engine:
                fp = engine.core.fingerprint
                assert fp is not None
                params = {  # a producer with the key that never answers (signed below)
                    "do_remote_prefill": True,
                    "remote_engine_id": "silent",
                    "remote_host": "127.0.0.1",
                    "remote_port": silent.getsockname()[1],
                    "remote_request_id": "p",
                    "remote_block_ids": [0, 1],
                    "fingerprint": attrs.evolve(fp, tp_rank=0).key(),
                    "block_size": 16,
                    "tp_size": 1,
                }
                batch = prompts()
                params = signed(params, batch[0])
                waiting = [
                    engine.generate(batch[0], PARAMS, request_id=r, kv_transfer_params=params)
                    for r in ("w1", "w2")
                ]
                worker = nixl_worker(engine)
                with anyio.fail_after(30):
                    while len(worker.peers) < 2:
                        await anyio.sleep(0.001)
                    out = await run(engine, batch[2], "free")
                assert len(out.token_ids) == PARAMS.max_tokens
                assert len(worker.peers) == 2  # still waiting, one handshake for both
                name = f"nixl-handshake-127.0.0.1:{silent.getsockname()[1]}"
                threads = [t for t in threading.enumerate() if t.name == name]
                assert len(threads) == 1
                for rid in ("w1", "w2"):
                    engine.abort(rid)
                for stream in waiting:
                    async for _ in stream:
                        pass
                assert not any((await until_idle(engine)).values())
            threads[0].join(0)
            assert not threads[0].is_alive()
        finally:
            silent.close()
