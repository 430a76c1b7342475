"""``HeldSends``: a producer rank's finished prefills, held until their consumer is done.

A held request is released (its blocks freed by the scheduler) exactly once: when a
consumer's notification names it, or when its lease runs out. Notifications are hostile
and unordered, so each case is idempotent:

- one that arrives before its send is held (the consumer read faster than this rank got
  the step's metadata) is kept as *early*, for at most ``lease_s``, and releases the send
  as soon as it is held;
- one for a request released less than ``lease_s`` ago (repeated, or late after the
  lease ran out) is dropped, never kept as early: it must not release a later request
  that reuses the id while its consumer may still be reading. The cost of that rule: a
  reused id whose own notification comes early waits for its lease;
- one for a request this rank never held is kept as early and pruned after ``lease_s``.

Both kept sets are capped, so a flood of notifications costs bounded memory.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from pipeline.logger import get_logger

__all__ = ["HeldSends"]

log = get_logger()
_MAX_KEPT = 4096  # early notifications, and recently released ids, kept at most
_MAX_TICKETS = 4  # tickets kept per early notification's id


class HeldSends:
    """The sends one producer rank holds (see the module docstring).

    Args:
        lease_s: How long a send is held without a notification, and how long an early
            notification or a released id is remembered.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._held: dict[str, float] = {}  # req id -> lease deadline
        self._tickets: dict[str, str] = {}  # held req id -> its ticket
        self._early: dict[str, float] = {}  # notified before held -> when
        self._early_tickets: dict[str, list[str]] = {}  # ... under which tickets
        self._released: dict[str, float] = {}  # released -> when

    def __len__(self) -> int:
        """Sends held now."""
        return len(self._held)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held

    def hold(self, req_id: str, now: float, ticket: str = "", *, again: bool = False) -> bool:
        """Hold ``req_id``'s blocks until a notification names it under ``ticket`` or
        ``lease_s`` ends; whether it is held now. ``again``: the scheduler sent this hold
        once more (a step's output was lost): a send held or released already is left
        as it is."""
        if again and (req_id in self._held or req_id in self._released):
            return False
        self._held[req_id] = now + self.lease_s
        self._tickets[req_id] = ticket
        return True

    def release(self, req_id: str, now: float) -> bool:
        """Release ``req_id`` now (its consumer will never read it); whether it was
        held. Later notifications of it are dropped, as for any released send."""
        if req_id not in self._held:
            return False
        del self._held[req_id], self._tickets[req_id]
        self._released.pop(req_id, None)
        self._released[req_id] = now
        return True

    def take_released(self, notified: Iterable[tuple[str, str]], now: float) -> list[str]:
        """Apply the notifications ``(request id, ticket)`` that arrived since the
        previous call and the leases that ran out by ``now``; the sends released, each
        once in this holder's life (until its id is held again). A notification under
        another ticket than the send's frees nothing (it is dropped, and logged)."""
        for req_id, ticket in notified:
            if req_id in self._held or req_id not in self._released:
                self._early[req_id] = now
                tickets = self._early_tickets.setdefault(req_id, [])
                if ticket not in tickets and len(tickets) < _MAX_TICKETS:  # a forged one
                    tickets.append(ticket)  # must not hide the genuine one
            else:
                log.debug("nixl notification for a released send dropped", req_id=req_id)
        out = []
        for req_id in [r for r in self._early if r in self._held]:
            tickets = self._early_tickets.pop(req_id, [])
            if any(hmac.compare_digest(t, self._tickets[req_id]) for t in tickets):
                out.append(req_id)
            else:
                log.warning("nixl notification under a wrong ticket dropped", req_id=req_id)
            del self._early[req_id]
        for req_id in out:
            del self._held[req_id], self._tickets[req_id]
        for req_id, deadline in list(self._held.items()):
            if now > deadline:
                log.warning("nixl send lease expired; blocks freed", req_id=req_id)
                del self._held[req_id], self._tickets[req_id]
                out.append(req_id)
        for req_id in out:
            self._released.pop(req_id, None)  # re-insert: the dict stays in time order
            self._released[req_id] = now
        for kept in (self._early, self._released):
            for req_id in [r for r, t in kept.items() if now - t > self.lease_s]:
                del kept[req_id]
            if len(kept) > _MAX_KEPT:  # the oldest go (one pass: a flood stays linear)
                newest = list(kept.items())[-_MAX_KEPT:]
                kept.clear()
                kept.update(newest)
        if len(self._early_tickets) != len(self._early):  # pruned above
            for req_id in [r for r in self._early_tickets if r not in self._early]:
                del self._early_tickets[req_id]
        return out
