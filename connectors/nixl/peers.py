"""``PeerHandshakes``: one rank's handshakes with producer ranks, off the engine step.

The first read from a producer rank needs its :class:`PeerInfo`. Fetching it can take up
to ``handshake_timeout_s`` (a dead or silent producer), so it never runs inside a step:
:meth:`PeerHandshakes.wait` queues the read and starts the handshake with its peer on a
daemon thread, once per peer however many reads wait for it; a later step's
:meth:`PeerHandshakes.take_resolved` hands back each finished handshake with the reads
that waited for it, and the worker starts or fails them. Meanwhile every other request
keeps stepping.

Not thread-safe apart from the handshake threads themselves: every method is called from
the rank's event loop.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import attrs

from connectors.nixl.errors import HandshakeError, NixlError
from connectors.nixl.handshake import PeerInfo, fetch_peer_info
from connectors.nixl.metadata import RemoteRead
from connectors.nixl.transfer_key import TransferKey

__all__ = ["MAX_HANDSHAKES", "PeerHandshakes", "Resolved"]

_JOIN_S = 1.0  # how long close() waits for the threads (a fetch sees its stop in 50 ms)
MAX_HANDSHAKES = 64
"""Handshakes in flight at most (one thread each): params naming ever new peers cannot
start threads without bound."""


@attrs.frozen
class Resolved:
    """A finished handshake and the reads that waited for it.

    Attributes:
        engine_id: The peer engine.
        info: What the peer said, or ``None`` when the handshake failed.
        error: Why it failed (a :class:`HandshakeError`), or ``None``.
        reads: The reads queued for the peer, in order.
    """

    engine_id: str
    info: PeerInfo | None
    error: NixlError | None
    reads: tuple[RemoteRead, ...]


@attrs.define(eq=False)
class _Pending:
    future: Future[PeerInfo]
    thread: threading.Thread
    reads: list[RemoteRead]


class PeerHandshakes:
    """Handshakes in flight, one per peer engine, and the reads waiting for them.

    Args:
        timeout_s: Bound on one handshake (``handshake_timeout_s``).
        key: The transfer key the handshakes are signed with.
        sender: This engine's id (the peer logs it).
    """

    def __init__(self, timeout_s: float, key: TransferKey, sender: str) -> None:
        self.timeout_s = timeout_s
        self.key = key
        self.sender = sender
        self._pending: dict[str, _Pending] = {}
        self._stop = threading.Event()

    def __len__(self) -> int:
        """Reads waiting for a handshake."""
        return sum(len(p.reads) for p in self._pending.values())

    def wait(self, read: RemoteRead, port: int) -> None:
        """Queue ``read`` until its peer's handshake ends; start the handshake with
        ``read.host:port`` unless one with ``read.engine_id`` is already in flight.
        Returns at once.

        Raises:
            HandshakeError: :data:`MAX_HANDSHAKES` are in flight with other peers.
            RuntimeError: After :meth:`close`.
        """
        if self._stop.is_set():
            raise RuntimeError("nixl peer handshakes: wait after close")
        pending = self._pending.get(read.engine_id)
        if pending is None:
            if len(self._pending) >= MAX_HANDSHAKES:
                raise HandshakeError(
                    f"{read.host}:{port}", f"{MAX_HANDSHAKES} handshakes already in flight"
                )
            future: Future[PeerInfo] = Future()
            thread = threading.Thread(
                target=self._fetch,
                args=(future, read.host, port),
                name=f"nixl-handshake-{read.host}:{port}",
                daemon=True,
            )
            pending = self._pending[read.engine_id] = _Pending(future, thread, [])
            thread.start()
        pending.reads.append(read)

    def _fetch(self, future: Future[PeerInfo], host: str, port: int) -> None:
        try:
            info = fetch_peer_info(
                host, port, self.timeout_s, self._stop, key=self.key, sender=self.sender
            )
        except HandshakeError as exc:
            future.set_exception(exc)
        except Exception as exc:  # never lose a waiting read to an unexpected error
            future.set_exception(HandshakeError(f"{host}:{port}", repr(exc)))
        else:
            future.set_result(info)

    def drop(self, req_id: str) -> bool:
        """Forget the waiting read of ``req_id`` (its request finished); whether one
        was waiting. The handshake itself goes on (other reads may come for the peer)."""
        for pending in self._pending.values():
            for read in pending.reads:
                if read.req_id == req_id:
                    pending.reads.remove(read)
                    return True
        return False

    def take_resolved(self) -> list[Resolved]:
        """The handshakes that ended since the previous call, with their reads. Never
        blocks."""
        out: list[Resolved] = []
        for engine_id, pending in list(self._pending.items()):
            if not pending.future.done():
                continue
            del self._pending[engine_id]
            reads = tuple(pending.reads)
            exc = pending.future.exception()
            if exc is None:
                out.append(Resolved(engine_id, pending.future.result(), None, reads))
            else:
                error = exc if isinstance(exc, NixlError) else NixlError(repr(exc))
                out.append(Resolved(engine_id, None, error, reads))
        return out

    def close(self) -> None:
        """Stop every handshake and wait (up to a second) for its thread; forget the
        waiting reads. Idempotent."""
        self._stop.set()
        pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.thread.join(_JOIN_S)
