"""Why a nixl read failed, as a :class:`~pipeline.artifacts.LoadFailureCause`."""

from __future__ import annotations

from connectors.nixl.errors import HandshakeError, PeerMismatchError, TransferError
from pipeline.artifacts import LoadFailureCause

__all__ = ["load_failure_cause"]

# The reasons the side channel and the agent give (connectors.nixl.handshake / .agent).
_REFUSED = ("peer refused", "claim refused")
_TIMED_OUT = "not done by its deadline"
_ADMISSION = "agent metadata refused"


def load_failure_cause(exc: BaseException) -> LoadFailureCause:
    """The cause of a failed read from the error that failed it.

    ``peer_mismatch``: the producer is another model or layout; ``refused``: its side
    channel refused the handshake or the claim of the blocks (ticket, key);
    ``handshake``: it could not be reached or did not answer (a dead producer), or
    NIXL refused its agent metadata; ``read_timeout``: the READ was not done by its
    deadline; ``read_error``: the READ failed otherwise; ``unknown``: anything else.
    """
    if isinstance(exc, PeerMismatchError):
        return LoadFailureCause.PEER_MISMATCH
    if isinstance(exc, HandshakeError):
        refused = exc.reason.startswith(_REFUSED)
        return LoadFailureCause.REFUSED if refused else LoadFailureCause.HANDSHAKE
    if isinstance(exc, TransferError):
        if exc.reason == _TIMED_OUT:
            return LoadFailureCause.READ_TIMEOUT
        if exc.reason.startswith(_ADMISSION):
            return LoadFailureCause.HANDSHAKE
        return LoadFailureCause.READ_ERROR
    return LoadFailureCause.UNKNOWN
