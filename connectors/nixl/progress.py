"""A NIXL agent whose progress thread sleeps between events instead of spinning.

``nixl_cu12``'s ``nixl_agent`` starts the UCX backend's progress thread with
``pthrDelay = 0``, hard-coded: the thread then ``poll()``\\ s the UCX worker with a zero
timeout in a loop, one core busy per agent for as long as it lives, even when nothing
moves (measured: ~95% of a core in both producer and consumer while idle). On a small
host that takes the cores the copy and the model need: a READ ran at ~30% of ``memcpy``
beside two spinning agents, at 55-68% without them.

With a delay the same thread sleeps in ``poll()`` on the worker's event fd and wakes on
each UCX event (a wireup message, a notification, a remote completion); the delay only
bounds the sleep (NIXL's fallback for a wakeup UCX misses). The thread stays: it answers
a peer's wireup and takes notifications while this engine does not step (without it a
consumer's READ of an idle producer never completes). ``nixl_agent_config`` has no field
for the delay, so :func:`new_agent` hands ``nixl_agent`` a config class that keeps ours,
for the duration of that one call, under a lock. Where that is not possible (another
``nixl_cu12`` layout) the agent is made as ``nixl_cu12`` makes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["PROGRESS_DELAY_US", "new_agent"]

PROGRESS_DELAY_US = 10_000
"""Longest sleep of the agent's progress thread between UCX events (microseconds)."""

_LOCK = threading.Lock()


class _Bindings:
    """``nixl_cu12._bindings`` with ``nixlAgentConfig`` keeping our ``pthrDelay``."""

    def __init__(self, bindings: Any, config: type) -> None:
        self._bindings = bindings
        self.nixlAgentConfig = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


def _sleeping_config(base: type) -> type:
    class SleepingConfig(base):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay":
                value = PROGRESS_DELAY_US
            super().__setattr__(name, value)

    return SleepingConfig


def new_agent(name: str, devices: str = "") -> Any:
    """A ``nixl_cu12`` agent named ``name`` on the UCX backend (see the module docstring),
    on the network ``devices`` UCX may use (``UCX_NET_DEVICES``: e.g. ``"lo"`` keeps its
    sockets on loopback; ``""``: every interface, UCX's default).

    Blocks while NIXL starts (UCX context, workers, threads). Thread-safe.

    Raises:
        Whatever ``nixl_agent`` raises (no plugin, UCX failing to start).
    """
    from nixl_cu12 import _api, nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=["UCX"])
    with _LOCK, _net_devices(devices):
        bindings = getattr(_api, "nixlBind", None)
        base = getattr(bindings, "nixlAgentConfig", None)
        try:
            patched = _Bindings(bindings, _sleeping_config(base)) if base else None
        except TypeError:  # not subclassable
            patched = None
        if patched is None:
            return nixl_agent(name, config)
        _api.nixlBind = patched
        try:
            return nixl_agent(name, config)
        finally:
            _api.nixlBind = bindings


@contextlib.contextmanager
def _net_devices(devices: str) -> Iterator[None]:
    """``UCX_NET_DEVICES=devices`` while the agent's UCX context is made (UCX reads its
    configuration from the environment then; the backend's ``ucx_devices`` parameter
    does not reach it in ``nixl_cu12``), unless the variable is set already: an
    operator's own setting wins. Under :data:`_LOCK` (the environment is the process's)."""
    if not devices or "UCX_NET_DEVICES" in os.environ:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = devices
    try:
        yield
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)
