"""``KVEventSubscriber``: a replica's KV event batches, in sequence order, gaps replayed.

The subscriber side of :mod:`pipeline.kv_events.publisher`'s protocol: a SUB socket for
live batches and, when the replica has a replay endpoint, a DEALER socket that asks for
missed sequence ranges. Hostile input is refused at the door: a message that is not
``[topic, 8-byte seq, payload]`` or whose payload is not a ``KVEventBatch`` is dropped
(and counted), never applied.

What a hostile publisher can make a subscriber hold is bounded: a frame larger than
``max_message_bytes`` disconnects the publisher before it is read (``zmq.MAXMSGSIZE``;
ZeroMQ reconnects), at most :data:`RCVHWM` messages wait per socket, and a replay keeps
at most ``max_replay_bytes`` of payload (the oldest batches beyond it are dropped and
reported as missed, so what is kept is the newest part, which never makes an index hold
a block the replica removed) and ends within its ``timeout_s``, end marker or not.

Blocking calls that return within their ``timeout_s`` (plus the decoding of one
message); one thread; not thread-safe.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NamedTuple

import msgspec

from pipeline.errors import TransportError
from pipeline.kv_events.events import KVEventBatch, decode_batch
from pipeline.kv_events.publisher import END_SEQ
from pipeline.kv_events.zmq_support import import_zmq, is_ipv6

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_REPLAY_BYTES",
    "RCVHWM",
    "KVEventSubscriber",
    "ReplayResult",
    "SequencedBatch",
]

MAX_MESSAGE_BYTES = 1 << 20
"""The default cap of one frame (a batch's payload): one engine step's events are a few
KiB to a few hundred (a prefill of 16,384 tokens with token ids is about 50 KiB)."""
MAX_REPLAY_BYTES = 8 << 20
"""The default cap of the payloads one replay keeps (decoded, a hash takes about five
times its bytes on the wire)."""
RCVHWM = 16
"""Messages ZeroMQ keeps waiting per socket before it stops reading the publisher."""


class SequencedBatch(NamedTuple):
    """A decoded batch and its sequence number."""

    seq: int
    batch: KVEventBatch


class ReplayResult(NamedTuple):
    """What a replay request got back.

    Attributes:
        batches: The buffered batches from the requested start on, oldest first.
        missed: The sequence numbers asked for that the replica's buffer no longer holds
            (``range(start, first returned)``); empty when nothing was lost.
    """

    batches: list[SequencedBatch]
    missed: range


class KVEventSubscriber:
    """Receives one replica's KV event batches.

    Args:
        endpoint: The replica's PUB endpoint (connected to).
        replay_endpoint: Its ROUTER endpoint, or ``None`` (gaps are then only reported).
        topic: The topic to subscribe to (``""``: every message).
        next_seq: The first sequence number expected; ``0`` for a subscriber that wants
            the whole history (a live batch numbered higher triggers a replay).
        max_message_bytes: The largest frame accepted (see the module).
        max_replay_bytes: The most payload bytes one replay keeps.

    Attributes:
        next_seq: The sequence number the next batch in order must have.
        gaps: Sequence ranges lost for good (not in the replica's replay buffer).
        rejected: Messages refused as malformed.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        next_seq: int = 0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
    ) -> None:
        zmq = import_zmq()
        self._zmq = zmq
        self._max_message_bytes = max_message_bytes
        self._max_replay_bytes = max_replay_bytes
        self._ctx = zmq.Context()
        self._replay: Any = None
        try:
            self._sub = self._socket(zmq.SUB, endpoint)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            if replay_endpoint is not None:
                self._replay = self._socket(zmq.DEALER, replay_endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.next_seq = next_seq
        self.gaps: list[range] = []
        self.rejected = 0

    def _socket(self, kind: int, endpoint: str) -> Any:
        zmq = self._zmq
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        if is_ipv6(endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        """Close both sockets and the context; idempotent; never waits on the peer."""
        if self._ctx.closed:
            return
        self._ctx.destroy(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self, timeout_s: float) -> list[SequencedBatch]:
        """Wait up to ``timeout_s`` for one live message; return the batches it brings in
        order: none (nothing came, a duplicate, a malformed message), the batch itself,
        or, after a gap, the replayed batches before it too. A gap that replay cannot
        fill is added to :attr:`gaps` and skipped."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return []
        got = self._decode(self._sub.recv_multipart())
        if got is None or got.seq < self.next_seq:
            return []
        out: list[SequencedBatch] = []
        if got.seq > self.next_seq:
            out = self._fill(self.next_seq, got.seq, timeout_s)
        out.append(got)
        self.next_seq = got.seq + 1
        return out

    def replay(self, start: int, timeout_s: float) -> ReplayResult:
        """Ask the replay socket for every buffered batch from ``start`` on; at most
        ``max_replay_bytes`` of the newest are kept (the older ones count as missed).

        Raises:
            TransportError: No replay endpoint, or no end marker within ``timeout_s``
                (in all, however fast the batches come).
        """
        if self._replay is None:
            raise TransportError("no replay endpoint to ask for missed KV event batches")
        deadline = time.monotonic() + timeout_s
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        kept: deque[tuple[SequencedBatch, int]] = deque()
        size = 0
        dropped_to = start  # batches before this were dropped to stay within the cap
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._replay.poll(left_ms):
                raise TransportError(f"KV event replay from {start} timed out after {timeout_s}s")
            frames = self._replay.recv_multipart()
            if len(frames) == 3 and frames[1] == END_SEQ:
                break
            got = self._decode(frames)
            if got is None or got.seq < max(start, dropped_to):
                continue
            kept.append((got, len(frames[2])))
            size += len(frames[2])
            while size > self._max_replay_bytes:
                old, old_size = kept.popleft()
                size -= old_size
                dropped_to = old.seq + 1
        batches = [item for item, _ in kept]
        first = batches[0].seq if batches else dropped_to
        return ReplayResult(batches, range(start, max(start, first)))

    def catch_up(self, timeout_s: float) -> list[SequencedBatch]:
        """Replay from :attr:`next_seq` on (a late joiner's first call); lost ranges go to
        :attr:`gaps`. Returns the batches in order and advances :attr:`next_seq`."""
        result = self.replay(self.next_seq, timeout_s)
        return self._accept(result)

    def _fill(self, start: int, stop: int, timeout_s: float) -> list[SequencedBatch]:
        if self._replay is None:
            self.gaps.append(range(start, stop))
            return []
        result = self.replay(start, timeout_s)
        kept = [b for b in result.batches if b.seq < stop]
        return self._accept(ReplayResult(kept, result.missed), stop=stop)

    def _accept(self, result: ReplayResult, stop: int | None = None) -> list[SequencedBatch]:
        if result.missed:
            self.gaps.append(result.missed)
        out: list[SequencedBatch] = []
        expected = result.missed.stop if result.missed else self.next_seq
        for item in result.batches:
            if item.seq != expected:  # a hole inside the buffer (a dropped batch)
                self.gaps.append(range(expected, item.seq))
            out.append(item)
            expected = item.seq + 1
        if stop is not None and expected < stop:
            self.gaps.append(range(expected, stop))
            expected = stop
        self.next_seq = max(self.next_seq, expected)
        return out

    def _decode(self, frames: list[bytes]) -> SequencedBatch | None:
        """``[topic, seq, payload]`` (live) or ``[b"", seq, payload]`` (replay)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.rejected += 1
            return None
        try:
            batch = decode_batch(frames[2])
        except msgspec.DecodeError:
            self.rejected += 1
            return None
        return SequencedBatch(int.from_bytes(frames[1], "big"), batch)
