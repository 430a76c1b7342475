"""Tenant fair share: the order in which waiting requests are offered a free slot.

With ``tenant_fair_share`` on, each free slot goes to the waiting request of the tenant
(``Request.tenant``; ``None`` is one tenant too) that has the fewest running requests,
ties broken by queue order; under the priority policy a better priority comes first,
then the tenant's running count. A tenant's flood therefore gets no more slots than any
other tenant with requests waiting, and a lone tenant still gets every slot (the order
only decides who goes first; nobody waits for a slot that is free).

The order is computed lazily, per step, from the queues alone: nothing about a tenant
is kept between steps, so a client that names many tenants costs no memory beyond its
requests (which ``max_queue_depth`` bounds) and no metric label.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Iterator

from pipeline.request import Request

__all__ = ["FairOrder"]


class FairOrder:
    """The waiting requests of one step, in fair-share order; iterate once.

    Args:
        waiting: The waiting queue, in its own order (FCFS or priority).
        running: The running requests (each counts against its tenant).
        by_priority: A request's ``priority`` comes before its tenant's count.

    Call :meth:`started` for each request that was admitted (it counts for its tenant
    from then on); a request passed over (skipped, parked) does not count.
    """

    def __init__(self, waiting: Iterable[Request], running: Iterable[Request], by_priority: bool):
        self._queues: dict[str | None, deque[tuple[int, Request]]] = {}
        for position, request in enumerate(waiting):
            queue = self._queues.get(request.tenant)
            if queue is None:
                queue = self._queues[request.tenant] = deque()
            queue.append((position, request))
        self._running = Counter(r.tenant for r in running)
        self._by_priority = by_priority

    def started(self, request: Request) -> None:
        """``request`` was admitted: its tenant has one more running request."""
        self._running[request.tenant] += 1

    def _key(self, tenant: str | None) -> tuple[int, int, int]:
        position, head = self._queues[tenant][0]
        return (head.priority if self._by_priority else 0, self._running[tenant], position)

    def __iter__(self) -> Iterator[Request]:
        heap = [(*self._key(tenant), tenant) for tenant in self._queues]
        heapq.heapify(heap)  # positions are unique: the tenant is never compared
        while heap:
            tenant = heapq.heappop(heap)[-1]
            queue = self._queues[tenant]
            yield queue.popleft()[1]
            if queue:  # keyed after the caller said whether the one yielded started
                heapq.heappush(heap, (*self._key(tenant), tenant))
