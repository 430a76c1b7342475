"""What the publisher and the subscriber share about ZeroMQ: the optional import and
whether an endpoint needs IPv6 on."""

from __future__ import annotations

from types import ModuleType

from pipeline.errors import InvalidConfigError

__all__ = ["import_zmq", "is_ipv6"]


def import_zmq() -> ModuleType:
    """The ``zmq`` module (``pyzmq``: an optional dependency, imported on first use).

    Raises:
        InvalidConfigError: ``pyzmq`` is not installed.
    """
    try:
        import zmq
    except ImportError as exc:
        raise InvalidConfigError(
            "kv_events", "pyzmq", f"needs the pyzmq package (pip install pyzmq): {exc}"
        ) from exc
    return zmq


def is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` is a ``tcp://`` address with an IPv6 host (``tcp://[::]:5557``,
    ``tcp://[::1]:5557``), which ZeroMQ binds or connects only with ``zmq.IPV6`` set."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return ":" in host
