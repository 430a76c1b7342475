"""``NixlMetadata``: one step's reads, held sends and cancelled loads, for the workers.

Plain tuples of NamedTuples (str and int) so msgspec encodes it without pickle.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from connectors.base import KVConnectorMetadata

__all__ = ["HeldSend", "NixlMetadata", "RemoteRead"]


class RemoteRead(NamedTuple):
    """One consumer request's read: remote blocks of a producer into local blocks.

    Attributes:
        req_id: The consumer's request (reported in ``recving`` when the read is done).
        engine_id: The producer engine.
        host: Its side-channel host.
        port: Its rank-0 side-channel port (rank ``r`` reads from ``port + r``).
        remote_request_id: The producer's request, named in the notification that
            frees its blocks.
        remote_block_ids: Blocks to read, in order.
        local_block_ids: Where they land, in the same order.
        refused: Why the scheduler refused the read (the request's params name a
            producer of another model, block size or TP size), or ``""``: a refused
            read never contacts the producer, and its local blocks are reported as
            load errors, so the request recomputes or fails per ``load_failure_policy``.
        ticket: The producer's ticket for the blocks (checked by the consumer's
            scheduler when the request was admitted): the worker claims the blocks with
            it before reading, and names it in the notification that frees them.
    """

    req_id: str
    engine_id: str
    host: str
    port: int
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    refused: str = ""
    ticket: str = ""


class HeldSend(NamedTuple):
    """A finished prefill a producer rank now holds for its consumer.

    Attributes:
        req_id: The producer's request.
        ticket: The ticket its answer carried: a claim or notification under another
            one is refused.
        block_ids: Its blocks, the only ones a claim may name.
    """

    req_id: str
    ticket: str
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class NixlMetadata(KVConnectorMetadata):
    """What each worker does this step.

    Attributes:
        reads: Reads to start (consumer).
        sends: Finished prefills whose blocks are now held for a consumer (producer):
            reported in ``sending`` when the consumer's notification names them, or
            when ``lease_s`` runs out.
        cancels: Requests that finished while their read was in flight: their blocks
            are held until the read is over, then reported in ``sending``.
        releases: Held sends whose consumer will never read them (it refused the
            request; :meth:`~connectors.nixl.scheduler.NixlScheduler.release_transfer`):
            released at once by a rank where no claim was granted, reported in
            ``sending``; a rank being read keeps its hold until the notification.
        resent: Whether this also carries the previous step's instructions again (that
            step's output never came back, so they may never have reached a worker): a
            worker skips the reads it already has and the sends it holds or released.
    """

    reads: tuple[RemoteRead, ...] = ()
    sends: tuple[HeldSend, ...] = ()
    cancels: tuple[str, ...] = ()
    releases: tuple[str, ...] = ()
    resent: bool = False
