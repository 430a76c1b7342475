"""Tenant fair share: the order in which waiting requests are offered a free slot.

With ``tenant_fair_share`` on, each free slot goes to the waiting request of the tenant
(``Request.tenant``; ``None`` is one tenant too) that has the fewest running requests;
among those, the one served least recently (round robin), then queue order. Under the
priority policy a better priority comes first. A tenant's flood therefore gets no more
slots than any other tenant with requests waiting, even with one slot, and a lone tenant
still gets every slot (the order only decides who goes first; nobody waits for a slot
that is free).

Running counts are taken from the queues each step; the only memory kept between steps
is :class:`TenantLedger`, when each tenant was last served, bounded to
:data:`MAX_TRACKED_TENANTS` (the least recently served is forgotten first, and a
forgotten tenant is one never served: it goes first among equals, where the least
recently served would go anyway). A client that names many tenants costs no more, and
tenants are never a metric label.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator

from pipeline.request import Request

__all__ = ["MAX_TRACKED_TENANTS", "FairOrder", "TenantLedger"]

#: Most tenants whose last service :class:`TenantLedger` remembers.
MAX_TRACKED_TENANTS = 4096


class TenantLedger:
    """When each tenant last had a request admitted (a tick that grows), at most
    ``capacity`` tenants, least recently served forgotten first. Not thread-safe."""

    def __init__(self, capacity: int = MAX_TRACKED_TENANTS) -> None:
        self._capacity = capacity
        self._served: OrderedDict[str | None, int] = OrderedDict()
        self._tick = 0

    def __len__(self) -> int:
        return len(self._served)

    def last_served(self, tenant: str | None) -> int:
        """The tick of ``tenant``'s last admission; -1 if never (or forgotten)."""
        return self._served.get(tenant, -1)

    def served(self, tenant: str | None) -> None:
        """``tenant`` had a request admitted now."""
        self._tick += 1
        self._served[tenant] = self._tick
        self._served.move_to_end(tenant)
        if len(self._served) > self._capacity:
            self._served.popitem(last=False)


class FairOrder:
    """The waiting requests of one step, in fair-share order; iterate once.

    Args:
        waiting: The waiting queue, in its own order (FCFS or priority).
        running: The running requests (each counts against its tenant).
        by_priority: A request's ``priority`` comes before its tenant's share.
        ledger: When each tenant was last served; :meth:`started` updates it.

    Call :meth:`started` for each request that was admitted (it counts for its tenant
    from then on); a request passed over (skipped, parked) does not count.
    """

    def __init__(
        self,
        waiting: Iterable[Request],
        running: Iterable[Request],
        by_priority: bool,
        ledger: TenantLedger,
    ) -> None:
        self._queues: dict[str | None, deque[tuple[int, Request]]] = {}
        for position, request in enumerate(waiting):
            queue = self._queues.get(request.tenant)
            if queue is None:
                queue = self._queues[request.tenant] = deque()
            queue.append((position, request))
        self._running = Counter(r.tenant for r in running)
        self._by_priority = by_priority
        self._ledger = ledger

    def started(self, request: Request) -> None:
        """``request`` was admitted: its tenant has one more running request and was
        served now."""
        self._running[request.tenant] += 1
        self._ledger.served(request.tenant)

    def _key(self, tenant: str | None) -> tuple[int, int, int, int]:
        position, head = self._queues[tenant][0]
        priority = head.priority if self._by_priority else 0
        return priority, self._running[tenant], self._ledger.last_served(tenant), position

    def __iter__(self) -> Iterator[Request]:
        heap = [(*self._key(tenant), tenant) for tenant in self._queues]
        heapq.heapify(heap)  # positions are unique: the tenant is never compared
        while heap:
            tenant = heapq.heappop(heap)[-1]
            queue = self._queues[tenant]
            yield queue.popleft()[1]
            if queue:  # keyed after the caller said whether the one yielded started
                heapq.heappush(heap, (*self._key(tenant), tenant))
