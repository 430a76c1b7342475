"""The errors of the ``nixl`` connector, each a :class:`~pipeline.errors.KvstepError`."""

from __future__ import annotations

from pipeline.errors import KvstepError, short_repr

__all__ = ["HandshakeError", "NixlError", "PeerMismatchError", "TransferError"]


class NixlError(KvstepError, RuntimeError):
    """Base class of the nixl connector's errors."""


class HandshakeError(NixlError):
    """A peer's side channel could not be reached, timed out, or answered garbage.

    Attributes:
        address: ``host:port`` of the peer.
        reason: What went wrong.
    """

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"nixl handshake with {address} failed: {reason}")


class PeerMismatchError(NixlError, ValueError):
    """A peer's KV was made by another model or has another layout: never read it.

    Attributes:
        engine_id: The peer engine.
        field: The field that differs.
        local: Our value.
        remote: The peer's value.
    """

    def __init__(self, engine_id: str, field: str, local: object, remote: object) -> None:
        self.engine_id = engine_id
        self.field = field
        self.local = local
        self.remote = remote
        super().__init__(
            f"nixl peer {short_repr(engine_id)} differs in {field}: "
            f"local {short_repr(local)}, remote {short_repr(remote)}"
        )


class TransferError(NixlError):
    """A NIXL read failed, or did not complete within its deadline.

    Attributes:
        engine_id: The peer engine read from.
        reason: What went wrong.
    """

    def __init__(self, engine_id: str, reason: str) -> None:
        self.engine_id = engine_id
        self.reason = reason
        super().__init__(f"nixl read from {short_repr(engine_id)} failed: {reason}")
