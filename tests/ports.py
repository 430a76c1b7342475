"""Loopback ports for the servers a test starts: free now, and out of everyone else's way.

Binding port 0 and closing the socket gives an *ephemeral* port: the kernel hands the same
range to every ``connect()`` and ``bind(0)`` on the machine, so between the probe and the
server's own bind, another process (the other xdist worker's engine, a client) may take it
(a NIXL handshake test failed so: "Address already in use"). :func:`free_port` picks
below the kernel's ephemeral range instead, from a slice of its own per xdist worker, and
never hands out a port twice in one process.
"""

from __future__ import annotations

import os
import random
import socket
import threading

__all__ = ["free_port"]

_FLOOR = 10_000


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999  # Linux's default
    return low, high


def _pool() -> range:
    """This process's slice of the ports outside the ephemeral range."""
    low, high = _ephemeral()
    start, stop = (_FLOOR, low) if low - _FLOOR >= 4_000 else (high + 1, 65_536)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    if worker:  # workers share the range; the controller (no worker id) gets all of it
        width = (stop - start) // max(count, 1)
        start, stop = start + index * width, start + (index + 1) * width
    return range(start, stop)


_lock = threading.Lock()
_given: set[int] = set()
_order: list[int] = []


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port ``p`` with ``p .. p + count - 1`` all bindable on 127.0.0.1 now, none given
    out before by this process (rank ``r`` of a server may serve on ``p + r``)."""
    with _lock:
        if not _order:
            pool = list(_pool())
            random.Random(os.getpid()).shuffle(pool)
            _order.extend(pool)
        for i, port in enumerate(_order):
            block = range(port, port + count)
            if block.stop > 65_536 or any(p in _given for p in block):
                continue
            if all(_bindable(p) for p in block):
                _given.update(block)
                del _order[i]
                return port
    raise RuntimeError(f"no {count} free consecutive loopback ports left")
