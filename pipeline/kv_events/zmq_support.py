"""What the publisher and the subscriber share about ZeroMQ: the optional import and
vLLM's bind-or-connect rule."""

from __future__ import annotations

from types import ModuleType

from pipeline.errors import InvalidConfigError

__all__ = ["import_zmq", "should_bind"]


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


def should_bind(endpoint: str) -> bool:
    """Whether a PUB ``endpoint`` is bound (``*``, ``::``, ``ipc://``, ``inproc://``) rather
    than connected to, as vLLM decides."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )
