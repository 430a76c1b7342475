"""The backends of one pool, picked by the pool's policy among the healthy ones."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["Backend", "BackendPool"]


@attrs.define(eq=False)
class Backend:
    """One upstream server.

    Attributes:
        url: Its base URL, without a trailing slash.
        healthy: Whether it is in rotation; cleared by a failed health poll or a failed
            connection, set again by a passing health poll.
        in_flight: Requests this proxy has open on it (sent, answer not yet closed).
    """

    url: str
    healthy: bool = True
    in_flight: int = 0


class BackendPool:
    """A named pool (``backend``, ``prefill`` or ``decode``) of backends.

    ``policy`` is ``round-robin`` (each healthy backend in turn), ``least-loaded``
    (the healthy backend with the fewest requests open through this proxy; ties in
    turn) or ``kv-aware`` (:attr:`chooser`'s pick). Only the event loop's thread
    touches a pool; :meth:`pick` never blocks and never awaits, so two requests can
    never pick while a poll is half way through an update.
    """

    def __init__(self, name: str, urls: tuple[str, ...], policy: str = "round-robin") -> None:
        self.name = name
        self.policy = policy
        self.backends = tuple(Backend(url) for url in urls)
        self._turn = itertools.count()
        #: The kv-aware policy's choice among candidates (in turn order) given the
        #: prompt's block hashes; set by the proxy when ``policy`` is ``kv-aware``.
        self.chooser: Callable[[Sequence[Backend], Sequence[Any]], Backend] | None = None

    def __repr__(self) -> str:
        healthy = f"{self.num_healthy}/{len(self.backends)}"
        return f"BackendPool({self.name!r}, {self.policy}, healthy={healthy})"

    @property
    def num_healthy(self) -> int:
        """How many backends are in rotation."""
        return sum(b.healthy for b in self.backends)

    def pick(self, exclude: tuple[Backend, ...] = (), hashes: Sequence[Any] = ()) -> Backend | None:
        """The healthy backend the policy chooses for a prompt of block ``hashes``, not
        one of ``exclude``, or ``None`` when there is none."""
        count = len(self.backends)
        start = next(self._turn)
        turn = (self.backends[(start + offset) % count] for offset in range(count))
        candidates = [b for b in turn if b.healthy and b not in exclude]
        if not candidates:
            return None
        if self.chooser is not None:
            return self.chooser(candidates, hashes)
        if self.policy == "least-loaded":
            return min(candidates, key=lambda b: b.in_flight)  # the first of ties
        return candidates[0]
