"""The ZeroMQ publisher and subscriber: order, replay, gaps, hostile input, clean close."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq

from pipeline.errors import InvalidConfigError, TransportError
from pipeline.kv_events import (
    AllBlocksCleared,
    BatchQueue,
    BlockRemoved,
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
    encode_batch,
)

LIMIT_S = 30.0  # a bound on a hang, never a timing assertion


def _config(tmp_path: Path, **kw: object) -> KVEventsConfig:
    return KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay", **kw
    )


def _removed(n: int) -> list[BlockRemoved]:
    return [BlockRemoved(block_hashes=[n], medium="GPU")]


def _replay_all(sub: KVEventSubscriber, start: int, last: int):  # type: ignore[no-untyped-def]
    """Replay from ``start`` until the publisher thread has sent batch ``last``."""
    give_up = time.monotonic() + LIMIT_S
    while True:
        result = sub.replay(start, 5.0)
        if result.batches and result.batches[-1].seq == last:
            return result
        assert time.monotonic() < give_up, "the publisher never sent the last batch"
        time.sleep(0.01)


class TestPublisher:
    def test_replay_serves_the_buffer_and_reports_what_is_gone(self, tmp_path: Path) -> None:
        """Six batches, a three-batch buffer: replay from 0 returns 3, 4, 5 and says 0-2
        are missed; replay from 4 returns 4, 5 and misses nothing."""
        pub = ZmqEventPublisher(_config(tmp_path, buffer_steps=3))
        try:
            assert [pub.publish(_removed(i)) for i in range(6)] == list(range(6))
            with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
                result = _replay_all(sub, 0, 5)
                assert [b.seq for b in result.batches] == [3, 4, 5]
                assert [b.batch.events for b in result.batches] == [_removed(i) for i in (3, 4, 5)]
                assert result.missed == range(0, 3)
                result = sub.replay(4, 5.0)
                assert [b.seq for b in result.batches] == [4, 5]
                assert result.missed == range(4, 4)
                sub.catch_up(5.0)
                assert sub.gaps == [range(0, 3)]
                assert sub.next_seq == 6
        finally:
            pub.close()

    def test_live_batches_arrive_in_order(self, tmp_path: Path) -> None:
        """A subscriber receives every batch, numbered 0, 1, 2, ..., live or replayed."""
        pub = ZmqEventPublisher(_config(tmp_path))
        try:
            with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
                got = []
                give_up = time.monotonic() + LIMIT_S
                for i in range(20):
                    pub.publish(_removed(i))
                while sub.next_seq < 20 and time.monotonic() < give_up:
                    got += sub.poll(0.2) or sub.catch_up(5.0)
                assert [b.seq for b in got] == list(range(20))
                assert [b.batch.events for b in got] == [_removed(i) for i in range(20)]
                assert sub.gaps == []
        finally:
            pub.close()

    def test_hostile_replay_request_is_ignored(self, tmp_path: Path) -> None:
        """A malformed replay request gets no answer and does not stop the socket."""
        pub = ZmqEventPublisher(_config(tmp_path))
        ctx = zmq.Context()
        try:
            pub.publish([AllBlocksCleared()])
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", b"short"])
            dealer.send_multipart([b"x", b"", b"12345678"])
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = dealer.recv_multipart()
            while frames[1] != (-1).to_bytes(8, "big", signed=True):
                assert frames[1] == (0).to_bytes(8, "big")
                frames = dealer.recv_multipart()
            assert frames == [b"", (-1).to_bytes(8, "big", signed=True), b""]
            dealer.close()
        finally:
            ctx.term()
            pub.close()

    def test_close_stops_the_thread_and_is_idempotent(self, tmp_path: Path) -> None:
        """close() ends the publisher thread; publishing after it raises; a second close
        does nothing."""
        pub = ZmqEventPublisher(_config(tmp_path))
        assert "kvstep-kv-events" in [t.name for t in threading.enumerate()]
        pub.publish(_removed(1))
        pub.close()
        pub.close()
        assert "kvstep-kv-events" not in [t.name for t in threading.enumerate()]
        with pytest.raises(RuntimeError, match="closed"):
            pub.publish(_removed(2))

    def test_an_address_in_use_names_the_field(self) -> None:
        """A replay endpoint that cannot be bound raises InvalidConfigError naming it."""
        first = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"))
        try:
            assert first.endpoint.startswith("tcp://127.0.0.1:")
            clash = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint=first.endpoint)
            with pytest.raises(InvalidConfigError, match=r"kv_events\.replay_endpoint"):
                ZmqEventPublisher(clash)
        finally:
            first.close()
        assert "kvstep-kv-events" not in [t.name for t in threading.enumerate()]


class TestBatchQueue:
    def test_full_queue_drops_the_oldest_and_counts(self) -> None:
        """Past max_size the oldest waiting batch goes; numbering continues, so the
        subscriber sees the hole."""
        queue = BatchQueue(2)
        batches = [KVEventBatch(ts=0.0, events=_removed(i)) for i in range(3)]
        assert [queue.put(b) for b in batches] == [(0, None), (1, None), (2, 0)]
        assert queue.dropped == 1
        assert [queue.get(), queue.get(), queue.get()] == [(1, batches[1]), (2, batches[2]), None]


class TestSubscriber:
    def _raw_pub(self, ctx: zmq.Context, tmp_path: Path) -> zmq.Socket:
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{tmp_path}/raw")
        return sock

    def _send_until(self, sock: zmq.Socket, sub: KVEventSubscriber, frames: list, done) -> list:  # type: ignore[no-untyped-def]
        """Resend (PUB drops messages until the SUB has joined) until ``done(got)``."""
        give_up = time.monotonic() + LIMIT_S
        while time.monotonic() < give_up:
            sock.send_multipart(frames)
            got = sub.poll(0.05)
            if done(got):
                return got
        raise AssertionError("the subscriber never received the message")

    def test_malformed_messages_are_rejected_and_a_dropped_batch_is_a_gap(
        self, tmp_path: Path
    ) -> None:
        """Garbage frames are counted and skipped; seq 2 after seq 0 without a replay
        socket records the gap [1, 2)."""
        ctx = zmq.Context()
        sock = self._raw_pub(ctx, tmp_path)
        try:
            with KVEventSubscriber(f"ipc://{tmp_path}/raw") as sub:
                garbage = [b"", b"\x00" * 8, b"\xc1"]
                assert self._send_until(sock, sub, garbage, lambda _: sub.rejected) == []
                payload = encode_batch(KVEventBatch(ts=0.0, events=_removed(0)))
                first = [b"", (0).to_bytes(8, "big"), payload]
                assert [b.seq for b in self._send_until(sock, sub, first, bool)] == [0]
                third = [b"", (2).to_bytes(8, "big"), payload]
                assert [b.seq for b in self._send_until(sock, sub, third, bool)] == [2]
                assert sub.gaps == [range(1, 2)]
                with pytest.raises(TransportError):
                    sub.replay(0, 0.1)
        finally:
            sock.close()
            ctx.term()
