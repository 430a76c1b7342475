"""The tests' port helper: ports outside the kernel's ephemeral range, never twice."""

from __future__ import annotations

import socket

import ports
from ports import _ephemeral, free_port


def test_ports_are_new_bindable_and_not_ephemeral() -> None:
    low, high = _ephemeral()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert not any(low <= p <= high for p in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_block_of_consecutive_ports() -> None:
    """Rank r of a server serves on p + r: every port of the block is free and reserved."""
    first = free_port(4)
    for port in range(first, first + 4):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert all(free_port() not in range(first, first + 4) for _ in range(50))


def test_a_port_in_use_is_skipped() -> None:
    """The next candidate, taken by another socket, is passed over (and stays a
    candidate for later)."""
    free_port()  # the pool is shuffled on first use
    candidate = ports._order[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", candidate))
        taken.listen()
        assert free_port() != candidate
        assert candidate in ports._order
