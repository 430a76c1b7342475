"""A framed, message-typed channel over a connected stream socket.

Each frame is an 8-byte little-endian length followed by one msgpack-encoded
:mod:`pipeline.executors.wire` message. The async side waits on the socket with
:func:`anyio.wait_readable` / :func:`anyio.wait_writable`, so it never blocks the event
loop and works under asyncio and trio; the blocking side (``*_sync``) serves the
start-up handshake, which runs before any event loop does.

Cancellation-safe reads: bytes already read stay in the channel's buffer, so a
``recv`` cancelled half-way through a frame loses nothing and the next ``recv``
continues it. Sends are shielded: a frame is written whole or the channel is broken.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable

import anyio

from pipeline.errors import TransportError
from pipeline.executors import wire

__all__ = ["Channel", "PeerGone"]

_HEADER = struct.Struct("<Q")
_CHUNK = 1 << 20


class PeerGone(TransportError):
    """The other end closed the connection (its process exited or was killed)."""


class Channel:
    """One end of an engine↔worker connection. One reader and one writer at a time.

    Args:
        sock: A connected stream socket (a ``socketpair`` end); the channel owns it.
        peer: How to name the other end in errors (``"worker rank 1"``).
        max_frame_bytes: Frames larger than this are refused (a corrupt length).
    """

    def __init__(self, sock: socket.socket, *, peer: str, max_frame_bytes: int = 1 << 31) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self.closed = False

    # ------------------------------------------------------------------ framing

    def _frame(self, message: wire.Message | bytes) -> bytes:
        body = message if isinstance(message, bytes) else wire.encode(message)
        return _HEADER.pack(len(body)) + body

    def _pop_frame(self) -> wire.Message | None:
        body = self._pop_body()
        return None if body is None else wire.decode(body)

    def _pop_body(self) -> bytes | None:
        """The next whole frame's body, removed from the buffer (so a body that fails to
        decode leaves the channel in step), or ``None`` while it is incomplete."""
        if len(self._buf) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buf)
        if size > self.max_frame_bytes:
            raise TransportError(
                f"frame of {size} bytes from {self.peer} exceeds {self.max_frame_bytes}"
            )
        end = _HEADER.size + size
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[_HEADER.size : end])
        del self._buf[:end]
        return body

    def _read_some(self) -> bool:
        """Read what is available into the buffer; ``False`` when nothing was."""
        try:
            chunk = self.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerGone(f"connection to {self.peer} failed: {exc}") from exc
        if not chunk:
            raise PeerGone(f"{self.peer} closed the connection")
        self._buf += chunk
        return True

    # -------------------------------------------------------------------- async

    async def send(self, message: wire.Message | bytes) -> None:
        """Send one message (or an already encoded message body).

        Raises:
            TransportError: The message cannot be encoded (nothing is sent).
            PeerGone: The peer is gone.
        """
        data = memoryview(self._frame(message))
        with anyio.CancelScope(shield=True):
            while data:
                try:
                    sent = self.sock.send(data)
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_writable(self.sock)
                    continue
                except OSError as exc:
                    raise PeerGone(f"sending to {self.peer} failed: {exc}") from exc
                data = data[sent:]

    async def recv(
        self, *, alive: Callable[[], bool] | None = None, poll_s: float = 0.25
    ) -> wire.Message:
        """Wait for the next message.

        Args:
            alive: Called every ``poll_s`` while waiting; ``False`` means the peer is
                dead even though its socket is still open.
            poll_s: How often ``alive`` is asked.

        Raises:
            PeerGone: The connection closed, or ``alive()`` turned false.
            TransportError: A malformed frame (it is consumed: the next ``recv`` reads
                the frame after it).
        """
        return wire.decode(await self.recv_frame(alive=alive, poll_s=poll_s))

    async def recv_frame(
        self, *, alive: Callable[[], bool] | None = None, poll_s: float = 0.25
    ) -> bytes:
        """Wait for the next frame and return its body undecoded (see :meth:`recv`).

        For a reader that must survive a message it cannot decode (the worker answers
        ``StepFailed`` for it); the frame is consumed either way.

        Raises:
            PeerGone: The connection closed, or ``alive()`` turned false.
            TransportError: A frame longer than ``max_frame_bytes``.
        """
        while True:
            body = self._pop_body()
            if body is not None:
                return body
            if self._read_some():
                continue
            if alive is None:
                await anyio.wait_readable(self.sock)
                continue
            with anyio.move_on_after(poll_s):
                await anyio.wait_readable(self.sock)
                continue
            if not alive():
                raise PeerGone(f"{self.peer} is no longer running")

    # --------------------------------------------------------------- blocking

    def send_sync(self, message: wire.Message, *, timeout_s: float = 30.0) -> None:
        """Blocking :meth:`send`, for the start-up handshake.

        Raises:
            PeerGone: The peer is gone or did not read within ``timeout_s``.
        """
        data = memoryview(self._frame(message))
        deadline = time.monotonic() + timeout_s
        while data:
            try:
                data = data[self.sock.send(data) :]
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerGone(f"{self.peer} did not read within {timeout_s}s") from None
                select.select([], [self.sock], [], min(left, 0.25))
            except OSError as exc:
                raise PeerGone(f"sending to {self.peer} failed: {exc}") from exc

    def recv_sync(
        self, *, timeout_s: float, alive: Callable[[], bool] | None = None
    ) -> wire.Message:
        """Blocking :meth:`recv` with a deadline, for the start-up handshake.

        Raises:
            PeerGone: The peer is gone, or sent nothing within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._pop_frame()
            if message is not None:
                return message
            if self._read_some():
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerGone(f"{self.peer} sent nothing within {timeout_s}s")
            if alive is not None and not alive():
                raise PeerGone(f"{self.peer} is no longer running")
            select.select([self.sock], [], [], min(left, 0.25))

    def close(self) -> None:
        """Close the socket; idempotent."""
        if not self.closed:
            self.closed = True
            self.sock.close()
