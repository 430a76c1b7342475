"""The side channel: a rank serves its :class:`PeerInfo` on a ZeroMQ REP socket.

One request, one reply, msgpack-encoded with typed decoding (never pickle). Every frame
from a peer is hostile: the sockets cap message sizes (``zmq.MAXMSGSIZE``), a request
must be exactly :data:`REQUEST`, and a reply must decode as :class:`HandshakeReply`
with every field in range, within a timeout, or :class:`HandshakeError` is raised. A
closed port fails at once (a plain TCP connect first: ZeroMQ would retry a refused
connection quietly until the timeout), and a fetch can be stopped from another thread.
``pyzmq`` is imported when a socket is made, so importing this module needs no zmq.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Annotated

import msgspec

from connectors.nixl.errors import HandshakeError
from pipeline.logs import get_logger

if TYPE_CHECKING:
    import zmq

__all__ = [
    "MAX_REPLY_BYTES",
    "REQUEST",
    "HandshakeReply",
    "HandshakeServer",
    "PeerInfo",
    "fetch_peer_info",
]

log = get_logger()

REQUEST = b"kvstep-nixl/1 peer-info"
"""The only request a handshake server answers."""
MAX_REPLY_BYTES = 16 << 20
"""Largest reply a client accepts (agent metadata is a few KiB)."""
_MAX_REQUEST_BYTES = 256
_POLL_MS = 50  # how often a waiting fetch looks at its stop event
_PROBE_S = 0.5  # bound on the TCP connect that detects a closed port
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_Positive = Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
_Addr = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class PeerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a rank tells a peer about its agent and its paged KV cache.

    Attributes:
        engine_id: The engine the rank belongs to.
        agent_name: Its NIXL agent's name.
        agent_metadata: Its NIXL agent's metadata (for ``add_remote_agent``).
        fingerprint: The model's rank-independent fingerprint key.
        block_size: Tokens per KV block.
        dtype: The KV dtype, e.g. ``"float32"``.
        tp_rank: The rank.
        tp_size: Number of ranks.
        num_blocks: Blocks in each layer's cache.
        block_bytes: Bytes of one block of K (or V) of one layer.
        mem_type: ``"DRAM"`` or ``"VRAM"``.
        device_id: The device of the cache (0 for host memory).
        layer_addrs: Base address of each layer's ``[2, num_blocks, ...]`` cache.
    """

    engine_id: _Name
    agent_name: _Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_REPLY_BYTES)]
    fingerprint: _Name
    block_size: _Positive
    dtype: _Name
    tp_rank: _Count
    tp_size: _Positive
    num_blocks: _Count
    block_bytes: _Positive
    mem_type: Annotated[str, msgspec.Meta(pattern="^(DRAM|VRAM)$")]
    device_id: _Count
    layer_addrs: Annotated[tuple[_Addr, ...], msgspec.Meta(max_length=4096)]


class HandshakeReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A server's answer: the info, or why there is none."""

    info: PeerInfo | None = None
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""


_decoder = msgspec.msgpack.Decoder(HandshakeReply)


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    import zmq

    return zmq.Context.instance()


class HandshakeServer:
    """Answers :data:`REQUEST` with ``info`` on a REP socket, on a daemon thread.

    Args:
        info: What to serve.
        host: Interface to bind (``"*"`` for all).
        port: TCP port; 0 binds a random free port (see :attr:`port`).

    Raises:
        HandshakeError: The address cannot be bound.
    """

    def __init__(self, info: PeerInfo, host: str, port: int) -> None:
        import zmq

        self._reply = msgspec.msgpack.encode(HandshakeReply(info=info))
        self._bad = msgspec.msgpack.encode(HandshakeReply(error="bad request"))
        self._socket = _context().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        try:
            if port == 0:
                self.port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._socket.close(0)
            raise HandshakeError(f"{host}:{port}", f"cannot bind: {exc}") from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        try:
            while not self._stop.is_set():
                if not self._socket.poll(50):
                    continue
                frames = self._socket.recv_multipart()
                good = len(frames) == 1 and frames[0] == REQUEST
                if not good:
                    log.warning("nixl handshake: bad request refused", frames=len(frames))
                self._socket.send(self._reply if good else self._bad)
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                log.warning("nixl handshake server stopped", error=repr(exc))
        finally:
            self._socket.close(0)

    def close(self) -> None:
        """Stop serving and close the socket; idempotent, waits up to a second."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)


def fetch_peer_info(
    host: str, port: int, timeout_s: float, stop: threading.Event | None = None
) -> PeerInfo:
    """Ask the server at ``host:port`` for its :class:`PeerInfo`; blocks up to ``timeout_s``.

    A closed port fails at once (a TCP connect is tried first: ZeroMQ itself would retry
    a refused connection silently until the timeout). Setting ``stop`` (from another
    thread) ends the wait within about 50 ms.

    Raises:
        HandshakeError: The connection was refused, no reply within ``timeout_s`` (a
            dead or silent peer), ``stop`` was set, an oversized or undecodable reply,
            or a reply carrying an error.
    """
    import zmq

    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    _probe(host, port, address, timeout_s)
    sock = _context().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        sock.connect(f"tcp://{address}")
        sock.send(REQUEST)
        while not sock.poll(_POLL_MS):
            if stop is not None and stop.is_set():
                raise HandshakeError(address, "stopped")
            if time.monotonic() > deadline:
                raise HandshakeError(address, f"no reply within {timeout_s:g}s")
        frames = sock.recv_multipart()
    except zmq.Again:
        raise HandshakeError(address, f"no reply within {timeout_s:g}s") from None
    except zmq.ZMQError as exc:
        raise HandshakeError(address, str(exc)) from exc
    finally:
        sock.close(0)
    if len(frames) != 1:
        raise HandshakeError(address, f"expected 1 frame, got {len(frames)}")
    try:
        reply = _decoder.decode(frames[0])
    except msgspec.DecodeError as exc:
        raise HandshakeError(address, f"undecodable reply: {exc}") from None
    if reply.info is None:
        raise HandshakeError(address, f"peer refused: {reply.error or 'no info'}")
    return reply.info


def _probe(host: str, port: int, address: str, timeout_s: float) -> None:
    """Fail fast on a refused (or unresolvable) address; a connect that times out
    decides nothing (the ZeroMQ wait that follows is bounded anyway)."""
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, _PROBE_S)):
            pass
    except TimeoutError:
        return
    except OSError as exc:
        raise HandshakeError(address, f"cannot connect: {exc}") from None
