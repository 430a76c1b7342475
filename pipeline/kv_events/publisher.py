"""``ZmqEventPublisher``: KV event batches on a ZeroMQ PUB socket, with a replay socket.

Wire protocol (vLLM's ``ZmqEventPublisher``; a subscriber written for vLLM reads it):

* **PUB** (``KVEventsConfig.endpoint``, bound; connected with ``connect=True``): one
  multipart message per batch, ``[topic, seq, payload]``: the UTF-8 topic, the batch's
  sequence number as 8 bytes big-endian (0, 1, 2, ... with no gap unless a batch was
  dropped), and the msgpack :class:`~pipeline.kv_events.events.KVEventBatch`.
* **ROUTER** (``KVEventsConfig.replay_endpoint``, always bound): a client (``REQ``, or
  ``DEALER`` sending an empty delimiter frame first) sends ``[b"", start]`` with
  ``start`` as 8 bytes big-endian; it gets ``[b"", seq, payload]`` for every buffered
  batch with ``seq >= start``, oldest first, then the end marker ``[b"", (-1 as 8
  signed bytes), b""]``. The buffer holds the last ``buffer_steps`` batches sent: a
  client that asked for a ``start`` older than the first ``seq`` it got back has lost
  the batches between.

Hostile peers: every frame a peer sends is capped (``zmq.MAXMSGSIZE``: a larger frame
disconnects that peer before it is read into memory; 256 bytes on the replay socket,
whose requests are 8, and on the PUB socket, which only reads subscriptions), at most
:data:`REPLAY_RCVHWM` requests wait on the replay socket, and replays are served at a
bounded rate per peer and in all (:class:`~pipeline.kv_events.replay_limit.ReplayLimiter`):
a request over the rate gets no answer (the client's replay times out; counted in
:attr:`ZmqEventPublisher.replays_refused` and logged), and a flood of requests never
delays the live batches (at most :data:`REPLAYS_PER_WAKE` are read between two sends).

Threads: :meth:`ZmqEventPublisher.publish` runs on the engine's thread and never blocks on
a socket: it numbers the batch, puts it in a bounded queue (when full, the oldest waiting
batch is dropped, counted in :attr:`~ZmqEventPublisher.dropped` and logged) and wakes the
publisher thread (a ``threading.Event``), which encodes, sends, keeps the replay buffer and
answers replay requests (polled every 20 ms). Every socket has ``linger=0``;
:meth:`~ZmqEventPublisher.close` sends what is queued, stops the thread and terminates the
publisher's own ZeroMQ context.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from pipeline.errors import InvalidConfigError
from pipeline.kv_events.config import KVEventsConfig
from pipeline.kv_events.events import KVEvent, KVEventBatch, encode_batch
from pipeline.kv_events.replay_limit import ReplayLimiter
from pipeline.kv_events.zmq_support import import_zmq, is_ipv6
from pipeline.logger import get_logger

__all__ = [
    "END_SEQ",
    "MAX_REQUEST_BYTES",
    "REPLAYS_PER_WAKE",
    "REPLAY_RCVHWM",
    "BatchQueue",
    "ZmqEventPublisher",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay (vLLM's ``END_SEQ``)."""

MAX_REQUEST_BYTES = 256
"""The largest frame a peer may send either socket (``zmq.MAXMSGSIZE``): a replay
request is ``[b"", 8 bytes]`` and a subscription a topic of at most 255 bytes."""
REPLAY_RCVHWM = 64
"""Replay requests ZeroMQ keeps waiting per peer before it stops reading that peer."""
REPLAYS_PER_WAKE = 64
"""Replay requests read between two sends of the live batches."""

_PUB_HWM = 100_000
_JOIN_TIMEOUT_S = 5.0
_REPLAY_POLL_S = 0.02
_log = get_logger()


class BatchQueue:
    """The bounded hand-over from the engine's thread to the publisher thread.

    :meth:`put` numbers each batch and, when ``max_size`` batches already wait, drops the
    oldest (counted in :attr:`dropped`). Thread-safe.
    """

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.dropped = 0
        self.next_seq = 0
        self._items: deque[tuple[int, KVEventBatch]] = deque()
        self._lock = threading.Lock()

    def put(self, batch: KVEventBatch) -> tuple[int, int | None]:
        """Queue ``batch``; returns its sequence number and the one dropped, if any."""
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            lost = None
            if len(self._items) >= self.max_size:
                lost = self._items.popleft()[0]
                self.dropped += 1
            self._items.append((seq, batch))
        return seq, lost

    def get(self) -> tuple[int, KVEventBatch] | None:
        """The oldest waiting batch and its number, or ``None``."""
        with self._lock:
            return self._items.popleft() if self._items else None

    def __len__(self) -> int:
        return len(self._items)


class ZmqEventPublisher:
    """Publishes KV event batches (see the module docstring for the protocol).

    Args:
        config: Endpoints, topic and sizes.

    Attributes:
        endpoint: The PUB socket's address; when bound, as ZeroMQ resolved it (the
            port chosen for ``tcp://host:*``).
        bound: Whether the PUB socket is bound (else connected: ``connect=True``).
        bad_replay_requests: Malformed replay requests ignored so far.
        replay_endpoint: The ROUTER socket's resolved address, or ``None``.

    Raises:
        InvalidConfigError: A socket cannot bind or connect (naming the field), or
            ``pyzmq`` is not installed.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        zmq = import_zmq()
        self._zmq = zmq
        self._topic = config.topic.encode()
        self._queue = BatchQueue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._sockets: list[Any] = []
        self._limiter = ReplayLimiter()
        self.bad_replay_requests = 0
        self.bound = not config.connect
        try:
            self._pub = self._socket(zmq.PUB, sndhwm=_PUB_HWM)
            self.endpoint = self._attach(
                self._pub, "endpoint", config.endpoint, connect=config.connect
            )
            self._replay: Any = None
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._socket(zmq.ROUTER, sndhwm=config.buffer_steps + 16)
                self._replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
                self.replay_endpoint = self._attach(
                    self._replay, "replay_endpoint", config.replay_endpoint
                )
        except BaseException:
            self._destroy()
            raise
        self._ready = threading.Event()
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstep-kv-events", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Batches dropped because the queue was full."""
        return self._queue.dropped

    @property
    def replays_refused(self) -> int:
        """Replay requests refused as over the rate (see the module)."""
        return self._limiter.refused

    def describe(self) -> dict[str, str | bool | None]:
        """``endpoint``, ``replay_endpoint``, ``topic`` and ``bound``: what a subscriber
        needs (``bound`` false: ``endpoint`` is a forwarder's, not one to subscribe to)."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self._topic.decode(),
            "bound": self.bound,
        }

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (:meth:`publish` then raises)."""
        return self._closing

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._queue.next_seq

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Queue one batch of ``events`` (one engine step's); returns its sequence number.

        Called on the engine's thread; never blocks on a socket. Not cancellation-relevant
        (synchronous).

        Raises:
            RuntimeError: The publisher is closed.
        """
        if self._closing:
            raise RuntimeError("the KV event publisher is closed")
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)
        seq, lost = self._queue.put(batch)
        if lost is not None:
            dropped = self._queue.dropped
            if dropped & (dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... drop
                _log.warning(
                    "kv_events_batch_dropped", seq=lost, dropped=dropped, queue=self._queue.max_size
                )
        self._ready.set()
        return seq

    def close(self) -> None:
        """Send what is queued, stop the thread, close every socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing = True
        self._ready.set()
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # cannot happen: nothing in the thread blocks
            _log.error("kv_events_publisher_stuck", timeout_s=_JOIN_TIMEOUT_S)
        self._destroy()

    # ------------------------------------------------------------------ internals

    def _socket(self, kind: int, *, sndhwm: int | None = None) -> Any:
        sock = self._ctx.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if sndhwm is not None:
            sock.setsockopt(self._zmq.SNDHWM, sndhwm)
        return sock

    def _attach(self, sock: Any, field: str, endpoint: str, *, connect: bool = False) -> str:
        try:
            if is_ipv6(endpoint):
                sock.setsockopt(self._zmq.IPV6, 1)
            if connect:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
            resolved = sock.getsockopt(self._zmq.LAST_ENDPOINT)
            return bytes(resolved).decode() or endpoint
        except self._zmq.ZMQError as exc:
            raise InvalidConfigError(
                f"kv_events.{field}", endpoint, f"must be an address this host can use ({exc})"
            ) from exc

    def _destroy(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        self._ctx.term()

    def _run(self) -> None:
        # Woken by a threading.Event, not a socket: publish() never releases the GIL, so
        # this thread's encoding runs when the engine's thread waits anyway. Replay
        # requests are looked at every _REPLAY_POLL_S.
        wait = None if self._replay is None else _REPLAY_POLL_S
        while True:
            self._ready.wait(wait)
            self._ready.clear()
            try:
                self._send_queued()
                # A bounded number per round: a flood waits in ZeroMQ (and its TCP
                # buffers), never between the live batches, and costs bounded CPU.
                for _ in range(REPLAYS_PER_WAKE):
                    if self._replay is None or not self._replay.poll(0):
                        break
                    self._serve_replay()
            except Exception as exc:  # keep publishing; a subscriber sees any gap
                _log.error("kv_events_publisher_error", error=repr(exc))
            if self._closing and not len(self._queue):
                return

    def _send_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            seq, batch = item
            payload = encode_batch(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_replay_requests += 1
            bad = self.bad_replay_requests
            if bad & (bad - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... malformed request
                _log.warning("kv_events_bad_replay_request", frames=len(frames), count=bad)
            return
        client, _, start_bytes = frames
        if not self._limiter.admit(client):
            refused = self._limiter.refused
            if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... refusal
                _log.warning("kv_events_replay_refused", reason="rate", refused=refused)
            return
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
