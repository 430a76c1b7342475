"""``ReplayLimiter``: how many replay requests the publisher serves, per peer and in all.

A replay answers an 8-byte request with up to the whole replay buffer, so a peer that
floods requests would make the publisher send (and ZeroMQ queue) the buffer again and
again. Each peer (a ROUTER routing id) and all peers together get a token bucket: a
request is served while its peer's bucket and the global one both hold a token, and
refused (not answered) otherwise. A peer can take a fresh routing id by reconnecting,
which is why the global bucket exists; the per-peer buckets (at most ``max_peers`` of
them, least recently used forgotten) keep one flooding peer from taking every token of
the others for long.

Plain synchronous code on the publisher thread; not thread-safe.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["ReplayLimiter"]


class _Bucket:
    """``rate`` tokens a second, at most ``burst`` saved up; starts full."""

    __slots__ = ("_last", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._last = now

    def ready(self, now: float) -> bool:
        """Whether a token is there (after refilling to ``now``); takes nothing."""
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        return self._tokens >= 1.0

    def take(self) -> None:
        """Spend one token (call after :meth:`ready` said yes)."""
        self._tokens -= 1.0


class ReplayLimiter:
    """Admits replay requests (see the module).

    Args:
        per_peer: Replays a second one peer may have served (its burst is twice that).
        overall: Replays a second all peers together may have served (burst twice that).
        max_peers: Per-peer buckets kept.
        clock: Seconds, monotonic (``time.monotonic``).

    Attributes:
        refused: Requests refused so far.
    """

    def __init__(
        self,
        per_peer: float = 4.0,
        overall: float = 16.0,
        *,
        max_peers: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_peer = per_peer
        self._clock = clock
        self._max_peers = max_peers
        self._global = _Bucket(overall, 2 * overall, clock())
        self._peers: OrderedDict[bytes, _Bucket] = OrderedDict()
        self.refused = 0

    def admit(self, peer: bytes) -> bool:
        """Whether ``peer``'s request may be served now (a token is then spent from its
        bucket and the global one); a refusal is counted in :attr:`refused`."""
        now = self._clock()
        bucket = self._peers.pop(peer, None)
        if bucket is None:
            bucket = _Bucket(self._per_peer, 2 * self._per_peer, now)
            if len(self._peers) >= self._max_peers:
                self._peers.popitem(last=False)
        self._peers[peer] = bucket
        if bucket.ready(now) and self._global.ready(now):
            bucket.take()
            self._global.take()
            return True
        self.refused += 1
        return False
