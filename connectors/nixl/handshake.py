"""The side channel: a rank serves its :class:`PeerInfo` and claims on a ZeroMQ REP socket.

One request, one reply, msgpack-encoded with typed decoding (never pickle). Both are
signed with the engines' :class:`~connectors.nixl.transfer_key.TransferKey`: a request
that is not (or is stale, or replayed) gets an unsigned refusal and nothing else, so
an outsider never sees an agent's metadata or a cache's addresses (with them it could
NIXL-write into the cache), and a reply that is not signed is refused by the client, so
whoever answers on a producer's port cannot pose as the producer. Every frame from a
peer is hostile: the sockets cap message sizes (``zmq.MAXMSGSIZE``), and a message must
decode as :class:`SideRequest` / :class:`SideReply` with every field in range, within a
timeout, or :class:`HandshakeError` is raised. A
closed port fails at once (a plain TCP connect first: ZeroMQ would retry a refused
connection quietly until the timeout), and a fetch can be stopped from another thread.
``pyzmq`` is imported when a socket is made, so importing this module needs no zmq.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Annotated

import msgspec

from connectors.nixl.errors import HandshakeError
from connectors.nixl.tickets import ClaimBook, ClaimResult
from connectors.nixl.transfer_key import TransferKey
from pipeline.logger import get_logger

if TYPE_CHECKING:
    import zmq

__all__ = [
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_SKEW_S",
    "HandshakeReply",
    "HandshakeServer",
    "PeerInfo",
    "SideReply",
    "SideRequest",
    "claim_blocks",
    "fetch_peer_info",
]

log = get_logger()

MAX_REPLY_BYTES = 16 << 20
"""Largest reply a client accepts (agent metadata is a few KiB)."""
MAX_REQUEST_BYTES = 128 << 10
"""Largest request a server reads (a claim lists a request's block ids)."""
_CLAIM_FIRST_RETRY_S = 0.0005  # a pending claim is asked again after this, doubling
_CLAIM_RETRY_S = 0.01  # ... up to this
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


class SideRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request on the side channel, signed with the transfer key.

    Attributes:
        kind: ``"peer-info"`` (the rank's :class:`PeerInfo`) or ``"claim"`` (read
            ``block_ids`` of ``request_id`` under ``ticket``: :mod:`~connectors.nixl.tickets`).
        sender: The asking engine's id (logged).
        nonce: 16 random bytes, echoed in the signed reply; a nonce seen before is refused.
        ts: When it was sent (``time.time()``); more than :data:`MAX_SKEW_S` away from
            the server's clock is refused.
        mac: :meth:`TransferKey.sign` of the request with ``mac`` empty.
    """

    kind: Annotated[str, msgspec.Meta(pattern="^(peer-info|claim)$")]
    sender: _Name
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    ts: float
    request_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    ticket: Annotated[str, msgspec.Meta(max_length=128)] = ""
    block_ids: Annotated[tuple[_Count, ...], msgspec.Meta(max_length=1 << 20)] = ()
    mac: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class SideReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The signed answer to a :class:`SideRequest` (``nonce`` is the request's)."""

    nonce: Annotated[bytes, msgspec.Meta(max_length=16)]
    reply: HandshakeReply
    claim: Annotated[str, msgspec.Meta(pattern="^(|ok|pending|refused)$")] = ""
    mac: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


_REQUEST_DOMAIN = b"kvstep-nixl/2 request"
_REPLY_DOMAIN = b"kvstep-nixl/2 reply"
MAX_SKEW_S = 60.0
"""How far a request's ``ts`` may be from the server's clock."""
_MAX_NONCES = 1 << 16
_decoder = msgspec.msgpack.Decoder(SideReply)
_request_decoder = msgspec.msgpack.Decoder(SideRequest)
_encoder = msgspec.msgpack.Encoder()


def _signed_request(key: TransferKey, request: SideRequest) -> bytes:
    body = _encoder.encode(request)
    return _encoder.encode(msgspec.structs.replace(request, mac=key.sign(_REQUEST_DOMAIN, body)))


def _signed_reply(key: TransferKey, reply: SideReply) -> bytes:
    body = _encoder.encode(reply)
    return _encoder.encode(msgspec.structs.replace(reply, mac=key.sign(_REPLY_DOMAIN, body)))


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    import zmq

    return zmq.Context.instance()


class HandshakeServer:
    r"""Answers signed :class:`SideRequest`\ s on a REP socket, on a daemon thread.

    A request that is not signed with ``key`` (or is stale, or replayed) gets an
    unsigned refusal and nothing else: no metadata, no address, no claim.

    Args:
        info: What to serve to a ``peer-info`` request.
        host: Interface to bind (``"*"`` for all).
        port: TCP port; 0 binds a random free port (see :attr:`port`).
        key: The transfer key requests must be signed with.
        book: The held requests a ``claim`` is checked against (none: every claim is
            refused).

    Raises:
        HandshakeError: The address cannot be bound.
    """

    def __init__(
        self,
        info: PeerInfo,
        host: str,
        port: int,
        key: TransferKey,
        book: ClaimBook | None = None,
    ) -> None:
        import zmq

        self._info = info
        self._key = key
        self._book = book
        self._nonces: dict[bytes, float] = {}
        self._warned: set[str] = set()  # kinds of refusal logged at warning once
        self._bad = _encoder.encode(
            SideReply(nonce=b"", reply=HandshakeReply(error="unauthenticated request"))
        )
        self._socket = _context().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
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
                self._socket.send(self._answer(frames))
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                log.warning("nixl handshake server stopped", error=repr(exc))
        finally:
            self._socket.close(0)

    def _answer(self, frames: list[bytes]) -> bytes:
        request = self._authentic(frames)
        if request is None:
            return self._bad
        if request.kind == "peer-info":
            reply = SideReply(nonce=request.nonce, reply=HandshakeReply(info=self._info))
        else:
            result = (
                self._book.claim(request.request_id, request.ticket, request.block_ids)
                if self._book is not None
                else ClaimResult("refused", "this rank holds nothing")
            )
            if result.status == "refused":
                self._say(
                    "claim", "nixl claim refused", peer=request.sender,
                    req_id=request.request_id, reason=result.reason,
                )  # fmt: skip
            reply = SideReply(
                nonce=request.nonce,
                reply=HandshakeReply(error=result.reason),
                claim=result.status,
            )
        return _signed_reply(self._key, reply)

    def _authentic(self, frames: list[bytes]) -> SideRequest | None:
        """The request in ``frames`` if signed, fresh and not replayed, else ``None``
        (logged once per kind of refusal at warning, then debug)."""
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames")
            request = _request_decoder.decode(frames[0])
            body = _encoder.encode(msgspec.structs.replace(request, mac=b""))
            if not self._key.verify(request.mac, _REQUEST_DOMAIN, body):
                raise ValueError("not signed with the transfer key")
            now = time.time()
            if not abs(now - request.ts) <= MAX_SKEW_S:
                raise ValueError("stale")
            if request.nonce in self._nonces:
                raise ValueError("replayed")
        except (ValueError, msgspec.DecodeError) as exc:
            self._say("request", "nixl side channel: request refused", reason=str(exc)[:200])
            return None
        self._nonces[request.nonce] = now
        while len(self._nonces) > _MAX_NONCES or (
            self._nonces and now - next(iter(self._nonces.values())) > 2 * MAX_SKEW_S
        ):
            del self._nonces[next(iter(self._nonces))]
        return request

    def _say(self, kind: str, event: str, **fields: object) -> None:
        """The first refusal of each kind at warning, later ones at debug (a peer
        sending garbage must not flood the log)."""
        if kind in self._warned:
            log.debug(event, **fields)
        else:
            self._warned.add(kind)
            log.warning(event, **fields, note="later ones are logged at debug")

    def close(self) -> None:
        """Stop serving and close the socket; idempotent, waits up to a second."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)


def _ask(
    host: str,
    port: int,
    key: TransferKey,
    request: SideRequest,
    timeout_s: float,
    stop: threading.Event | None,
) -> SideReply:
    """Send ``request`` signed and return the reply once its signature and nonce check.

    Raises:
        HandshakeError: Refused connection, no reply in time, ``stop`` set, an oversized
            or undecodable reply, or one not signed with ``key`` (an impostor, or a
            server of another key).
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
        sock.send(_signed_request(key, request))
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
    body = _encoder.encode(msgspec.structs.replace(reply, mac=b""))
    if reply.nonce != request.nonce or not key.verify(reply.mac, _REPLY_DOMAIN, body):
        error = reply.reply.error if not reply.mac else ""
        raise HandshakeError(
            address,
            f"peer refused: {error}" if error else "reply not signed with the transfer key",
        )
    return reply


def _request(
    kind: str, sender: str, request_id: str = "", ticket: str = "", block_ids: tuple[int, ...] = ()
) -> SideRequest:
    return SideRequest(
        kind=kind,
        sender=sender,
        nonce=secrets.token_bytes(16),
        ts=time.time(),
        request_id=request_id,
        ticket=ticket,
        block_ids=block_ids,
    )


def fetch_peer_info(
    host: str,
    port: int,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    key: TransferKey,
    sender: str = "-",
) -> PeerInfo:
    """Ask the server at ``host:port`` for its :class:`PeerInfo`; blocks up to ``timeout_s``.

    The request is signed with ``key`` and so must the reply be: a server without the
    key learns nothing and an impostor's answer is refused. A closed port fails at once
    (a TCP connect is tried first: ZeroMQ itself would retry a refused connection
    silently until the timeout). Setting ``stop`` (from another thread) ends the wait
    within about 50 ms.

    Raises:
        HandshakeError: The connection was refused, no reply within ``timeout_s`` (a
            dead or silent peer), ``stop`` was set, an oversized, undecodable or
            unsigned reply, or a reply carrying an error.
    """
    reply = _ask(host, port, key, _request("peer-info", sender), timeout_s, stop)
    if reply.reply.info is None:
        raise HandshakeError(f"{host}:{port}", f"peer refused: {reply.reply.error or 'no info'}")
    return reply.reply.info


def claim_blocks(
    host: str,
    port: int,
    *,
    key: TransferKey,
    sender: str,
    request_id: str,
    ticket: str,
    block_ids: tuple[int, ...],
    timeout_s: float,
    stop: threading.Event | None = None,
) -> None:
    """Claim ``block_ids`` of the producer's ``request_id`` under ``ticket``; returns
    once the producer rank says they may be read. A claim the producer has not seen the
    hold of yet is asked again (after 0.5 ms, doubling up to 10 ms) until ``timeout_s``.

    Raises:
        HandshakeError: Refused (wrong or used ticket, blocks not held, the request was
            released), no answer in time, or any failure of :func:`fetch_peer_info`.
    """
    deadline = time.monotonic() + timeout_s
    address = f"{host}:{port}"
    wait_s = _CLAIM_FIRST_RETRY_S  # the hold is usually bound within a producer step
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pending = f"claim of {request_id!r} still pending after {timeout_s:g}s"
            raise HandshakeError(address, pending)
        request = _request(
            "claim", sender, request_id=request_id, ticket=ticket, block_ids=block_ids
        )
        reply = _ask(host, port, key, request, left, stop)
        if reply.claim == "ok":
            return
        if reply.claim != "pending":
            raise HandshakeError(address, f"claim refused: {reply.reply.error or 'no reason'}")
        if stop is not None and stop.wait(wait_s):
            raise HandshakeError(address, "stopped")
        if stop is None:
            time.sleep(wait_s)
        wait_s = min(2 * wait_s, _CLAIM_RETRY_S)


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
