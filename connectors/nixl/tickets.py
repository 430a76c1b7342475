"""Transfer tickets: a producer's unforgeable say-so for one request's blocks.

A producer answers a finished prefill's ``kv_transfer_params`` with a **ticket**, an
HMAC-SHA256 under the :class:`~connectors.nixl.transfer_key.TransferKey` over
everything the consumer will act on: the producer's engine id and side-channel address,
its request id and block ids, a digest of the prompt's tokens, and an expiry time.

- The consumer checks the ticket when the request is admitted (:func:`check_ticket`): a
  client that edits any of those fields (another request's blocks, another host to
  connect to) or presents the ticket with another prompt is refused with a 400 before
  anything is read or connected to. So KV that arrives from a peer always belongs to the
  prompt it is cached under (no prefix-cache poisoning), and a client never chooses the
  peer an engine connects to.
- The producer checks it again on the side channel before any block is read
  (:class:`ClaimBook`): the consumer **claims** the request's blocks with the ticket,
  and only a request still held under that ticket can be claimed, once per rank. A
  ticket used once, or kept past its request's release, claims nothing, so blocks that
  were freed and now hold another request's KV are never read under an old ticket.
- The consumer's notification that frees the producer's blocks carries the ticket too:
  a notification for a request held under another ticket frees nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec

from connectors.nixl.transfer_key import TransferKey

__all__ = [
    "MAX_CLAIM_BOOK",
    "ClaimBook",
    "EXPIRED",
    "ClaimResult",
    "Ticket",
    "check_ticket",
    "issue_ticket",
    "prompt_digest",
]

_DOMAIN = b"kvstep-nixl/2 ticket"
MAX_CLAIM_BOOK = 1 << 16
"""Held requests one rank's book keeps at most (the scheduler holds no more)."""


def prompt_digest(
    token_ids: Sequence[int], extra_keys: Sequence[int | str | bytes] | None = None
) -> str:
    """SHA-256 (hex) of a prompt's token ids and what else its KV depends on (the
    request's block-hash extra keys: its LoRA adapter): what a ticket binds the blocks
    to, so a transfer never crosses adapters."""
    value: list[Any] = list(token_ids)
    if extra_keys:
        value = [value, list(extra_keys)]
    return hashlib.sha256(msgspec.msgpack.encode(value)).hexdigest()


@attrs.frozen(kw_only=True)
class Ticket:
    """What a ticket signs (the fields of ``kv_transfer_params`` a consumer acts on)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    prompt_digest: str
    expires_at: float  # time.time()

    def _encoded(self) -> bytes:
        return msgspec.msgpack.encode(attrs.astuple(self))


def issue_ticket(key: TransferKey, ticket: Ticket) -> str:
    """The ticket (hex) of ``ticket``'s fields."""
    return key.sign(_DOMAIN, ticket._encoded()).hex()


EXPIRED = "the ticket has expired"
"""What :func:`check_ticket` says of a genuine ticket past its time (not an attack: the
consumer recomputes, as when the producer's lease ran out)."""


def check_ticket(key: TransferKey, ticket: Ticket, mac: str, now: float | None = None) -> str:
    """Why ``mac`` is not a valid ticket of ``ticket``'s fields (:data:`EXPIRED` for a
    genuine one past its time), or ``""``."""
    now = time.time() if now is None else now
    try:
        raw = bytes.fromhex(mac)
    except ValueError:
        return "the ticket is not hex"
    if not key.verify(raw, _DOMAIN, ticket._encoded()):
        return "the ticket does not match the request (forged, edited, or another prompt)"
    if now > ticket.expires_at:
        return EXPIRED
    return ""


@attrs.frozen
class ClaimResult:
    """A claim's answer: ``"ok"`` (read now), ``"pending"`` (not held yet: the step that
    holds it has not reached this rank; ask again) or ``"refused"``, and why."""

    status: str
    reason: str = ""


@attrs.define
class _Held:
    ticket: str
    block_ids: frozenset[int]
    claimed: bool = False


class ClaimBook:
    """The requests one producer rank holds, by ticket, for the side channel to check.

    The rank's event loop :meth:`hold`\\ s and :meth:`release`\\ s; the side channel's
    thread :meth:`claim`\\ s. Thread-safe (one lock, held for dict operations only).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: dict[str, None] = {}  # recently released, oldest first

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req_id: str, ticket: str, block_ids: Sequence[int]) -> None:
        """``req_id``'s blocks may be claimed with ``ticket`` until :meth:`release`; a
        hold of a request already held is left as it is (a resent step)."""
        with self._lock:
            if req_id not in self._held and len(self._held) < MAX_CLAIM_BOOK:
                self._released.pop(req_id, None)
                self._held[req_id] = _Held(ticket, frozenset(block_ids))

    def release(self, req_id: str) -> None:
        """Nothing more can be claimed of ``req_id`` (its blocks are freed)."""
        with self._lock:
            self._release(req_id)

    def _release(self, req_id: str) -> None:
        if self._held.pop(req_id, None) is not None:
            self._released.pop(req_id, None)
            self._released[req_id] = None
            if len(self._released) > MAX_CLAIM_BOOK:
                del self._released[next(iter(self._released))]

    def release_unclaimed(self, req_id: str) -> bool:
        """:meth:`release` ``req_id`` unless a claim of it was granted (a consumer may be
        reading its blocks: they stay until its notification); whether it was released."""
        with self._lock:  # one lock: no claim is granted between the check and the release
            held = self._held.get(req_id)
            if held is None or held.claimed:
                return False
            self._release(req_id)
            return True

    def ticket_of(self, req_id: str) -> str | None:
        """The ticket ``req_id`` is held under, or ``None``."""
        with self._lock:
            held = self._held.get(req_id)
            return None if held is None else held.ticket

    def claim(self, req_id: str, ticket: str, block_ids: Sequence[int]) -> ClaimResult:
        """Claim ``block_ids`` of ``req_id`` with ``ticket``: once, only blocks it holds."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None:
                if req_id in self._released:
                    return ClaimResult("refused", "released")
                return ClaimResult("pending", "not held (yet)")
            if not hmac.compare_digest(held.ticket, ticket):
                return ClaimResult("refused", "wrong ticket")
            if held.claimed:
                return ClaimResult("refused", "already claimed")
            if not held.block_ids.issuperset(block_ids):
                return ClaimResult("refused", "blocks the request does not hold")
            held.claimed = True
            return ClaimResult("ok")
