"""The nixl connector's transport: NIXL reads between two agents, the ZeroMQ handshake."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("nixl_cu12")
zmq = pytest.importorskip("zmq")

from connectors.nixl.agent import NOTIF_PREFIX, KVAgent, _runs, notification  # noqa: E402
from connectors.nixl.errors import HandshakeError, PeerMismatchError, TransferError  # noqa: E402
from connectors.nixl.handshake import (  # noqa: E402
    MAX_SKEW_S,
    HandshakeServer,
    PeerInfo,
    SideRequest,
    _signed_request,
    claim_blocks,
    fetch_peer_info,
)
from connectors.nixl.tickets import ClaimBook  # noqa: E402
from connectors.nixl.transfer_key import TransferKey  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from nixl_peer import SHAPE, TEST_KEY, filled_cache  # noqa: E402


def make_agent(engine_id: str, caches: list[torch.Tensor], **kw: object) -> KVAgent:
    args: dict[str, object] = {
        "engine_id": engine_id,
        "fingerprint": "fp",
        "block_size": SHAPE[2],
        "tp_rank": 0,
        "tp_size": 1,
        "kv_caches": caches,
    }
    args.update(kw)
    return KVAgent(**args)  # type: ignore[arg-type]


def wait_read(agent: KVAgent, handle: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not agent.poll(handle):  # type: ignore[arg-type]
        assert time.monotonic() < end
        time.sleep(0.001)


@pytest.fixture
def pair():
    src = filled_cache()
    dst = [torch.zeros(SHAPE) for _ in range(2)]
    producer, consumer = make_agent("prod", src), make_agent("cons", dst)
    server = HandshakeServer(producer.info, "127.0.0.1", 0, TEST_KEY)
    yield producer, consumer, server, src, dst
    server.close()
    consumer.close()
    producer.close()


class TestRead:
    def test_bytes_equal_after_a_read_and_the_producer_is_notified(self, pair) -> None:
        """Remote blocks 3, 5 land in local blocks 1, 6 for every layer's K and V;
        the producer gets the notification naming the request."""
        producer, consumer, server, src, dst = pair
        consumer.add_peer(fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY))
        handle = consumer.start_read("prod", [3, 5], [1, 6], notification("req-1", "t1"), 5.0)
        wait_read(consumer, handle)
        for layer in range(2):
            assert torch.equal(dst[layer][:, 1], src[layer][:, 3])
            assert torch.equal(dst[layer][:, 6], src[layer][:, 5])
            assert dst[layer][:, 0].abs().sum() == 0  # nothing else was written
        end = time.monotonic() + 5
        notes: list[tuple[str, str]] = []
        while not notes and time.monotonic() < end:
            notes = producer.take_notifications()
            time.sleep(0.005)
        assert notes == [("req-1", "t1")]

    def test_runs_of_blocks_are_read_whole_and_split_where_either_side_breaks(self, pair) -> None:
        """Blocks consecutive on both sides go as one descriptor per layer, K and V;
        a run ends where the remote or the local ids stop being consecutive. Every
        block still lands where it belongs, and nothing else is written."""
        remote, local = [0, 1, 2, 4, 5, 6, 7], [2, 3, 4, 5, 0, 1, 6]
        starts_r, starts_l, counts = _runs(remote, local)
        runs = (starts_r.tolist(), starts_l.tolist(), counts.tolist())
        assert runs == ([0, 4, 5, 7], [2, 5, 0, 6], [3, 1, 2, 1])
        _, consumer, server, src, dst = pair
        consumer.add_peer(fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY))
        wait_read(consumer, consumer.start_read("prod", remote, local, b"", 5.0))
        for layer in range(2):
            for r, l_ in zip(remote, local, strict=True):
                assert torch.equal(dst[layer][:, l_], src[layer][:, r])
            assert dst[layer][:, 7].abs().sum() == 0

    def test_out_of_range_blocks_are_refused(self, pair) -> None:
        """A remote block id outside the peer's cache is a TransferError, not a read."""
        _, consumer, server, _, _ = pair
        consumer.add_peer(fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY))
        with pytest.raises(TransferError, match="out of"):
            consumer.start_read("prod", [SHAPE[1]], [0], b"", 5.0)
        with pytest.raises(TransferError, match="never admitted"):
            consumer.start_read("other", [0], [0], b"", 5.0)

    def test_hostile_notifications_are_dropped(self, pair) -> None:
        """Notifications without the prefix, a ticket or UTF-8 name no request."""
        producer, consumer, server, _, _ = pair
        consumer.add_peer(fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY))
        producer.add_peer(consumer.info)
        consumer._agent.send_notif(producer.name, b"free everything")
        consumer._agent.send_notif(producer.name, NOTIF_PREFIX + b"\xff\xfe")
        consumer._agent.send_notif(producer.name, NOTIF_PREFIX + b"no-ticket")
        consumer._agent.send_notif(producer.name, notification("ok", "t"))
        end, notes = time.monotonic() + 5, []
        while ("ok", "t") not in notes and time.monotonic() < end:
            notes += producer.take_notifications()
            time.sleep(0.005)
        assert notes == [("ok", "t")]


class TestMismatch:
    @pytest.mark.parametrize(
        ("field", "kw"),
        [
            ("fingerprint", {"fingerprint": "other-model"}),
            ("block_size", {"block_size": 8}),
            ("tp_size", {"tp_size": 2}),
        ],
    )
    def test_a_mismatched_peer_is_refused(self, field: str, kw: dict[str, object]) -> None:
        """A peer of another model, block size or TP size is refused by name."""
        other = make_agent("odd", filled_cache(), **kw)
        mine = make_agent("mine", [torch.zeros(SHAPE) for _ in range(2)])
        try:
            with pytest.raises(PeerMismatchError) as info:
                mine.add_peer(other.info)
            assert info.value.field == field
            assert not mine.has_peer("odd")
        finally:
            mine.close()
            other.close()

    def test_a_peer_of_another_dtype_is_refused(self) -> None:
        """float16 KV is never read into a float32 cache."""
        other = make_agent("half", [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(2)])
        mine = make_agent("mine", [torch.zeros(SHAPE) for _ in range(2)])
        try:
            with pytest.raises(PeerMismatchError, match="dtype"):
                mine.add_peer(other.info)
        finally:
            mine.close()
            other.close()


class TestHandshake:
    def test_a_closed_port_is_a_typed_error_within_the_timeout(self) -> None:
        """Nobody listening: HandshakeError at once (connection refused), not a hang."""
        with socket.socket() as probe:  # closed at once (a ZeroMQ socket closes later)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(HandshakeError, match="cannot connect"):
            fetch_peer_info("127.0.0.1", port, 0.3, key=TEST_KEY)
        assert time.monotonic() - start < 2.0

    def test_the_server_refuses_a_bad_request_and_keeps_serving(self, pair) -> None:
        """A request that is not a signed SideRequest gets an error reply; the next one
        is served."""
        _, _, server, _, _ = pair
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        sock.send(b"gimme")
        assert b"unauthenticated request" in sock.recv()
        sock.close(0)
        assert fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY).engine_id == "prod"

    @pytest.mark.parametrize(
        "reply",
        [b"\x00garbage", msgspec.msgpack.encode({"info": {"engine_id": True}}), b"x" * 70],
    )
    def test_a_garbage_reply_is_a_typed_error(self, reply: bytes) -> None:
        """A reply that does not decode as a SideReply is a HandshakeError."""
        sock = zmq.Context.instance().socket(zmq.REP)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        try:
            import threading

            def answer() -> None:
                if sock.poll(5000):
                    sock.recv()
                    sock.send(reply)

            thread = threading.Thread(target=answer)
            thread.start()
            with pytest.raises(HandshakeError):
                fetch_peer_info("127.0.0.1", port, 5.0, key=TEST_KEY)
            thread.join()
        finally:
            sock.close(0)


class TestDeadPeer:
    def test_a_killed_producer_is_a_typed_error_not_a_hang(self) -> None:
        """After the producer process dies, a read fails with TransferError and a
        handshake with HandshakeError, each within its timeout."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        helper = str(Path(__file__).parent / "nixl_peer.py")
        proc = subprocess.Popen(
            [sys.executable, helper, "dead"], stdout=subprocess.PIPE, text=True, env=env
        )
        dst = [torch.zeros(SHAPE) for _ in range(2)]
        consumer = make_agent("cons2", dst)
        try:
            assert proc.stdout is not None
            line = ""
            while not line.startswith("PORT "):
                line = proc.stdout.readline()
                assert line, "the producer exited"
            port = int(line.split()[1])
            consumer.add_peer(fetch_peer_info("127.0.0.1", port, 10.0, key=TEST_KEY))
            handle = consumer.start_read("dead", [2], [2], b"", 10.0)
            wait_read(consumer, handle)  # alive: the read works across processes
            assert torch.equal(dst[1][:, 2], filled_cache()[1][:, 2])
            proc.kill()
            proc.wait(10)
            start = time.monotonic()
            with pytest.raises(TransferError):
                handle = consumer.start_read("dead", [3], [3], b"", 2.0)
                while not consumer.poll(handle):
                    time.sleep(0.005)
            assert time.monotonic() - start < 5.0
            with pytest.raises(HandshakeError):
                fetch_peer_info("127.0.0.1", port, 0.3, key=TEST_KEY)
        finally:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
            consumer.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestVRAM:
    def test_a_read_between_cuda_caches_is_exact(self) -> None:
        """CUDA caches are registered as VRAM (device id in the descriptors): remote
        blocks 3, 5 land in local blocks 1, 6 of every layer's K and V on the GPU, and
        nothing else is written. Needs UCX built with CUDA support."""
        src = [t.cuda() for t in filled_cache()]
        dst = [torch.zeros(SHAPE, device="cuda") for _ in range(2)]
        producer, consumer = make_agent("prod", src), make_agent("cons", dst)
        assert producer.info.mem_type == "VRAM" and consumer.info.mem_type == "VRAM"
        assert producer.info.device_id == torch.cuda.current_device()
        server = HandshakeServer(producer.info, "127.0.0.1", 0, TEST_KEY)
        try:
            consumer.add_peer(fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY))
            handle = consumer.start_read("prod", [3, 5], [1, 6], notification("req-1", "t1"), 5.0)
            wait_read(consumer, handle)
            torch.cuda.synchronize()
            for layer in range(2):
                assert torch.equal(dst[layer][:, 1], src[layer][:, 3])
                assert torch.equal(dst[layer][:, 6], src[layer][:, 5])
                assert dst[layer][:, 0].abs().sum().item() == 0
        finally:
            server.close()
            consumer.close()
            producer.close()


OTHER_KEY = TransferKey(b"a key the producer does not have", "attacker")


def raw_request(key: TransferKey, **fields: object) -> bytes:
    """A SideRequest as an attacker would build it, signed with ``key``."""
    request = SideRequest(
        kind=str(fields.pop("kind", "peer-info")),
        sender="attacker",
        nonce=secrets.token_bytes(16),
        ts=float(fields.pop("ts", time.time())),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )
    return _signed_request(key, request)


def ask_raw(port: int, frame: bytes) -> bytes:
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(frame)
        return sock.recv()
    finally:
        sock.close(0)


def leaks_memory_layout(reply: bytes, info: PeerInfo) -> bool:
    """Whether ``reply`` carries the agent's metadata or any cache address."""
    addrs = [a.to_bytes(8, "big") for a in info.layer_addrs]
    return info.agent_metadata[:64] in reply or any(a in reply for a in addrs)


class TestSideChannelAuth:
    def test_an_outsider_without_the_key_learns_nothing(self, pair) -> None:
        """Audit H8: a request signed with another key, or not signed, gets an
        unsigned refusal without the agent's metadata or the cache's addresses (with
        them an outsider could NIXL-write into the producer's KV)."""
        producer, _, server, _, _ = pair
        for frame in (raw_request(OTHER_KEY), raw_request(OTHER_KEY, mac=b"")):
            reply = ask_raw(server.port, frame)
            assert b"unauthenticated request" in reply
            assert not leaks_memory_layout(reply, producer.info)
        with pytest.raises(HandshakeError, match="unauthenticated"):
            fetch_peer_info("127.0.0.1", server.port, 5.0, key=OTHER_KEY)
        ok = ask_raw(server.port, raw_request(TEST_KEY))  # the key holder is served
        assert leaks_memory_layout(ok, producer.info)

    def test_a_replayed_or_stale_request_is_refused(self, pair) -> None:
        """A signed request seen once is refused the second time, and one whose clock
        is off by more than MAX_SKEW_S is refused: a recorded request gets nothing."""
        producer, _, server, _, _ = pair
        frame = raw_request(TEST_KEY)
        assert leaks_memory_layout(ask_raw(server.port, frame), producer.info)
        replayed = ask_raw(server.port, frame)
        assert b"unauthenticated request" in replayed
        assert not leaks_memory_layout(replayed, producer.info)
        stale = ask_raw(server.port, raw_request(TEST_KEY, ts=time.time() - 2 * MAX_SKEW_S))
        assert b"unauthenticated request" in stale

    def test_an_impostor_on_the_producers_port_is_refused(self) -> None:
        """Audit H4: whoever answers on a producer's port without the key (it signs with
        another) is refused by the consumer: no peer info is taken from it."""
        impostor = make_agent("prod", filled_cache())
        server = HandshakeServer(impostor.info, "127.0.0.1", 0, OTHER_KEY)
        try:
            with pytest.raises(HandshakeError):
                fetch_peer_info("127.0.0.1", server.port, 5.0, key=TEST_KEY)
        finally:
            server.close()
            impostor.close()


class TestClaims:
    @pytest.fixture
    def served(self):
        producer = make_agent("prod", filled_cache())
        book = ClaimBook()
        server = HandshakeServer(producer.info, "127.0.0.1", 0, TEST_KEY, book)
        yield book, server.port
        server.close()
        producer.close()

    def claim(self, port: int, req: str, ticket: str, blocks: tuple[int, ...], t: float = 2.0):
        claim_blocks(
            "127.0.0.1", port, key=TEST_KEY, sender="cons", request_id=req,
            ticket=ticket, block_ids=blocks, timeout_s=t,
        )  # fmt: skip

    def test_only_a_held_request_under_its_ticket_is_claimed_once(self, served) -> None:
        """The producer's check on every read: the right ticket claims the request's
        own blocks once; a wrong ticket, other blocks, a second claim and a released
        request are refused at once."""
        book, port = served
        book.hold("req-a", "good", [3, 4, 5])
        with pytest.raises(HandshakeError, match="wrong ticket"):
            self.claim(port, "req-a", "forged", (3, 4))
        with pytest.raises(HandshakeError, match="does not hold"):
            self.claim(port, "req-a", "good", (3, 6))
        self.claim(port, "req-a", "good", (4, 5))
        with pytest.raises(HandshakeError, match="already claimed"):
            self.claim(port, "req-a", "good", (4, 5))
        book.hold("req-b", "b", [1])
        book.release("req-b")  # read and notified: its blocks may hold others' KV now
        start = time.monotonic()
        with pytest.raises(HandshakeError, match="released"):
            self.claim(port, "req-b", "b", (1,))
        assert time.monotonic() - start < 1.0

    def test_a_claim_before_the_hold_waits_for_it(self, served) -> None:
        """A consumer may claim before the producer's rank bound the step that holds the
        request: the claim is asked again until the hold arrives; an id never held
        times out (a typed error)."""
        import threading

        book, port = served
        timer = threading.Timer(0.2, book.hold, ("late", "t", [2]))
        timer.start()
        self.claim(port, "late", "t", (2,))
        timer.join()
        with pytest.raises(HandshakeError, match="pending"):
            self.claim(port, "never", "t", (2,), t=0.3)
