"""``EventWatch``: which kv-aware backends have stopped telling the proxy what they cache.

A kv-aware proxy that receives no event from a replica routes to it blind (it looks
like a replica with an empty cache), so that has to be said. A replica with no traffic
sends nothing, and one that only serves prompts it already holds stores no new block, so
silence alone proves nothing. The rule: a backend is **silent** once ``silent_after_s``
seconds have passed since the proxy routed to it a request that should have made it
store a block (one full prompt block or more that the index did not show on it) and no
event batch from it has arrived since. An event batch ends the silence at once.

On becoming silent the proxy logs one WARNING for that backend (``kv_events_silent``),
and one INFO when its events resume; the metrics
``kvstep_proxy_backend_events_silent{backend}`` (0/1) and
``kvstep_proxy_backend_last_event_age_seconds{backend}`` (since its last batch, or since
the proxy started when none came) and the proxy's ``/health`` (silent backends per pool)
show it meanwhile.

Only the event loop's thread touches a watch; nothing here blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio

from pipeline.logger import get_logger

__all__ = ["EventWatch", "watch_forever"]

_log = get_logger()


class EventWatch:
    """The silence rule of the module, for ``backends`` (their URLs).

    Args:
        backends: The kv-aware backends' URLs.
        silent_after_s: Seconds after an expecting request without any event before a
            backend counts as silent.
        clock: Monotonic seconds (``time.monotonic``).
    """

    def __init__(
        self,
        backends: Sequence[str],
        silent_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.silent_after_s = silent_after_s
        self._clock = clock
        start = clock()
        self._last_event = dict.fromkeys(backends, start)  # or since the proxy started
        self._heard = dict.fromkeys(backends, False)
        self._expecting_since: dict[str, float | None] = dict.fromkeys(backends)
        self._silent = dict.fromkeys(backends, False)

    def __repr__(self) -> str:
        return f"EventWatch(silent={self.silent_backends()}, after={self.silent_after_s}s)"

    def routed(self, backend: str, expects_store: bool) -> None:
        """A request went to ``backend``; ``expects_store``: it has a full prompt block
        the index did not show there, so a working replica will announce one."""
        if expects_store and self._expecting_since[backend] is None:
            self._expecting_since[backend] = self._clock()

    def heard(self, backend: str) -> None:
        """An event batch of ``backend`` arrived (and was applied)."""
        self._last_event[backend] = self._clock()
        self._heard[backend] = True
        self._expecting_since[backend] = None
        if self._silent[backend]:
            self._silent[backend] = False
            _log.info("kv_events_resumed", backend=backend)

    def check(self) -> list[str]:
        """Mark the backends that turned silent (one WARNING each); returns them."""
        now = self._clock()
        turned = []
        for backend, since in self._expecting_since.items():
            if since is None or self._silent[backend] or now - since < self.silent_after_s:
                continue
            self._silent[backend] = True
            turned.append(backend)
            _log.warning(
                "kv_events_silent",
                backend=backend,
                seconds=round(now - since, 1),
                ever_heard=self._heard[backend],
                detail="kv-aware routing is blind for this backend: no KV event came since "
                "a request that should have stored blocks; check that its "
                "--kv-events-endpoint is bound where the proxy connects (its /health "
                "kv_events, or --kv-events)",
            )
        return turned

    def silent(self, backend: str) -> bool:
        """Whether ``backend`` is silent now (as of the last :meth:`check`)."""
        return self._silent[backend]

    def silent_backends(self) -> list[str]:
        """The silent backends."""
        return [b for b, silent in self._silent.items() if silent]

    def last_event_age(self, backend: str) -> float:
        """Seconds since ``backend``'s last event batch (or since the watch started)."""
        return self._clock() - self._last_event[backend]


async def watch_forever(watch: EventWatch, interval_s: float) -> None:
    """:meth:`EventWatch.check` every ``interval_s`` seconds until cancelled."""
    while True:
        await anyio.sleep(interval_s)
        watch.check()
