"""The backends of one pool, picked round-robin among the healthy ones."""

from __future__ import annotations

import itertools

import attrs

__all__ = ["Backend", "BackendPool"]


@attrs.define(eq=False)
class Backend:
    """One upstream server.

    Attributes:
        url: Its base URL, without a trailing slash.
        healthy: Whether it is in rotation; cleared by a failed health poll or a failed
            connection, set again by a passing health poll.
    """

    url: str
    healthy: bool = True


class BackendPool:
    """A named pool (``prefill`` or ``decode``) of backends.

    Only the event loop's thread touches a pool; :meth:`pick` never blocks and never
    awaits, so two requests can never pick while a poll is half way through an update.
    """

    def __init__(self, name: str, urls: tuple[str, ...]) -> None:
        self.name = name
        self.backends = tuple(Backend(url) for url in urls)
        self._turn = itertools.count()

    def __repr__(self) -> str:
        return f"BackendPool({self.name!r}, healthy={self.num_healthy}/{len(self.backends)})"

    @property
    def num_healthy(self) -> int:
        """How many backends are in rotation."""
        return sum(b.healthy for b in self.backends)

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        """The next healthy backend in round-robin order, not one of ``exclude``, or
        ``None`` when there is none."""
        count = len(self.backends)
        start = next(self._turn)
        for offset in range(count):
            backend = self.backends[(start + offset) % count]
            if backend.healthy and backend not in exclude:
                return backend
        return None
