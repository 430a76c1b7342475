"""Faults as data: the :class:`Fault` spec, its validation, and the per-half injector.

Used by :mod:`connectors.testing.faulty` (the ``"faulty"`` connector) and
:mod:`connectors.testing.fault_stage` (the fault stage). A fault is plain data so it can
travel in ``EngineConfig.connector_options`` (msgspec encodes and decodes it, validation
included). See :mod:`connectors.testing.faulty` for what each action does at each call.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import anyio
import attrs
import msgspec
import structlog

from connectors.options import mapping, option, parse_options
from pipeline.checks import check_float, check_int
from pipeline.errors import FaultInjected, InvalidConfigError

__all__ = [
    "ACTIONS",
    "CALLS",
    "MAX_SYNC_HANG_S",
    "Fault",
    "FaultAction",
    "FaultInjector",
    "FiredFault",
    "cancel_current_task",
    "check_hang_s",
    "current_step_id",
    "parse_faulty_options",
]

FaultAction = Literal["raise", "hang", "corrupt", "cancel"]
ACTIONS: tuple[str, ...] = ("raise", "hang", "corrupt", "cancel")
MAX_SYNC_HANG_S = 5.0
"""Bound, in seconds, on a hang in a per-layer hook (a thread that cannot be cancelled)."""

_ASYNC = ("raise", "hang", "cancel")
_LAYER = ("raise", "hang")
_SYNC = ("raise",)
_DATA = ("raise", "corrupt")
CALLS: Mapping[str, tuple[str, ...]] = {
    "get_num_new_matched_tokens": _DATA,
    "update_state_after_alloc": _SYNC,
    "build_connector_meta": _DATA,
    "request_finished": _SYNC,
    "update_connector_output": _SYNC,
    "has_pending_work": _DATA,
    "register_kv_caches": _SYNC,
    "bind_connector_metadata": _SYNC,
    "start_load_kv": _ASYNC,
    "wait_for_layer_load": _LAYER,
    "save_kv_layer": _LAYER,
    "wait_for_save": (*_ASYNC, "corrupt"),
    "get_finished": (*_ASYNC, "corrupt"),
    "get_block_ids_with_load_errors": _DATA,
    "get_kv_stats": _SYNC,
    "clear_connector_metadata": _SYNC,
    "aclose": _ASYNC,
}
"""Each connector call a fault may name, and the actions it allows there."""

_LAYER_CALLS = ("wait_for_layer_load", "save_kv_layer")


def _opt_int(name: str, value: object, minimum: int) -> None:
    check_int(f"fault {name}", value, InvalidConfigError, lo=minimum, optional=True)


def check_hang_s(value: object) -> None:
    """Refuse a ``hang_s`` that is not a finite number >= 0 (``InvalidConfigError``)."""
    check_float("fault hang_s", value, InvalidConfigError, lo=0.0, hi=math.inf)


@attrs.frozen(kw_only=True)
class Fault:
    """One fault to inject at a connector call; plain data (msgspec round-trips it).

    Attributes:
        call: The connector method (a key of :data:`CALLS`).
        action: ``"raise"``, ``"hang"``, ``"corrupt"`` or ``"cancel"``; each call allows
            the actions :data:`CALLS` lists for it.
        step: Fire only in this step; ``None``: any step (and outside steps).
        rank: Fire only on this rank (0 on the scheduler half); ``None``: any rank.
        layer: Per-layer hooks only: fire only at this layer; ``None``: any layer.
        times: Fire at most this many times per rank; ``None``: every match.
        hang_s: Seconds a ``"hang"`` waits before the call is forwarded.

    Raises:
        InvalidConfigError: On construction, naming the bad field, the value and what
            is allowed (msgspec decoding raises ``msgspec.ValidationError`` with the
            same message).
    """

    call: str
    action: FaultAction
    step: int | None = None
    rank: int | None = None
    layer: int | None = None
    times: int | None = 1
    hang_s: float = 60.0

    def __attrs_post_init__(self) -> None:
        if self.call not in CALLS:
            raise InvalidConfigError("fault call", self.call, f"must be one of: {', '.join(CALLS)}")
        if self.action not in CALLS[self.call]:
            raise InvalidConfigError(
                "fault action", self.action, f"{self.call} allows: {', '.join(CALLS[self.call])}"
            )
        _opt_int("step", self.step, 0)
        _opt_int("rank", self.rank, 0)
        _opt_int("layer", self.layer, 0)
        _opt_int("times", self.times, 1)
        if self.layer is not None and self.call not in _LAYER_CALLS:
            raise InvalidConfigError(
                "fault layer", self.layer, "only wait_for_layer_load and save_kv_layer take one"
            )
        check_hang_s(self.hang_s)

    @classmethod
    def coerce(cls, value: object) -> Fault:
        """``value`` as a Fault: a Fault, or a mapping of its fields (e.g. from JSON).

        Raises:
            InvalidConfigError: Not a mapping, an unknown or missing key, a bad value.
        """
        if isinstance(value, Fault):
            return value
        if not isinstance(value, Mapping):
            raise InvalidConfigError("fault", value, "must be a Fault or a mapping of its fields")
        fields = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(value) - set(fields), key=str)
        if unknown:
            raise InvalidConfigError("fault key", unknown[0], f"allowed: {', '.join(fields)}")
        if "call" not in value or "action" not in value:
            raise InvalidConfigError("fault", dict(value), "needs both 'call' and 'action'")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The fault as plain values (what ``connector_options["faults"]`` may hold)."""
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result


@attrs.frozen(kw_only=True)
class FiredFault:
    """A fault that fired: at which call, in which step, on which rank."""

    call: str
    step: int | None
    rank: int
    fault: Fault


def _inner(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidConfigError(name, value, "must name the registered connector to wrap")
    return value


def _faults(name: str, value: object) -> tuple[Fault, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise InvalidConfigError(name, value, "must be a list of faults")
    return tuple(Fault.coerce(f) for f in value)


@attrs.frozen(kw_only=True)
class FaultyOptions:
    """``connector_options`` of the ``"faulty"`` connector, validated.

    Attributes:
        faults: The faults to inject.
        inner: The registered connector wrapped.
        inner_options: Its own options (checked by it, when it is built).
    """

    faults: tuple[Fault, ...] = option(_faults, default=())
    inner: str = option(_inner)
    inner_options: dict[str, Any] = option(mapping, factory=dict)


def parse_faulty_options(options: Mapping[str, Any]) -> FaultyOptions:
    """Validate ``{"inner": name, "inner_options": {...}, "faults": [...]}``; once, when a
    half is built.

    Raises:
        InvalidConfigError: An unknown key, a missing or empty ``inner``, options that
            are not a mapping, faults that are not a list, or a bad fault.
    """
    return parse_options(FaultyOptions, options, connector="faulty")


def current_step_id() -> int | None:
    """The ``step_id`` bound in structlog's contextvars (by the engine), or ``None``."""
    step = structlog.contextvars.get_contextvars().get("step_id")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


async def cancel_current_task(call: str, step: int | None, rank: int | None) -> None:
    """Cancel the running asyncio task natively (``task.cancel()``), then await once.

    The ``CancelledError`` lands at that await and propagates out of this call. Under
    another event loop (trio) there is no native task cancel: raises
    :class:`~pipeline.errors.FaultInjected` with ``action="cancel"`` instead.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop: trio
        task = None
    if task is None:
        raise FaultInjected(call, step, rank, action="cancel")
    task.cancel()
    await asyncio.sleep(0)
    raise FaultInjected(call, step, rank, action="cancel")  # pragma: no cover - swallowed


class FaultInjector:
    """The faults of one connector half (one rank), their firing counts, the actions.

    Thread-safe: the per-layer hooks fire from the forward thread while the event loop
    fires the step-level calls.

    Args:
        faults: Every fault of the connector; those for other ranks are dropped.
        rank: This half's rank.
        on_fire: Called with each :class:`FiredFault` (outside the lock).
    """

    def __init__(
        self, faults: Sequence[Fault], rank: int, on_fire: Callable[[FiredFault], None]
    ) -> None:
        self.rank = rank
        self._faults = [f for f in faults if f.rank is None or f.rank == rank]
        self._left = [f.times for f in self._faults]
        self._lock = threading.Lock()
        self._on_fire = on_fire

    def fire(self, call: str, layer: int | None = None) -> FiredFault | None:
        """Use one firing of the first matching fault that has firings left."""
        step = current_step_id()
        with self._lock:
            for i, fault in enumerate(self._faults):
                if fault.call != call or self._left[i] == 0:
                    continue
                if (fault.step is not None and fault.step != step) or (
                    fault.layer is not None and fault.layer != layer
                ):
                    continue
                left = self._left[i]
                if left is not None:
                    self._left[i] = left - 1
                break
            else:
                return None
        fired = FiredFault(call=call, step=step, rank=self.rank, fault=fault)
        self._on_fire(fired)
        return fired

    def sync(self, call: str, layer: int | None = None) -> Fault | None:
        """A synchronous call's fault: ``raise`` raises, ``hang`` sleeps (bounded by
        :data:`MAX_SYNC_HANG_S`); returns a ``corrupt`` fault (or a ``raise`` at
        ``clear_connector_metadata``, which the caller raises after clearing)."""
        fired = self.fire(call, layer)
        if fired is None:
            return None
        action = fired.fault.action
        if action == "hang":
            time.sleep(min(fired.fault.hang_s, MAX_SYNC_HANG_S))
            return None
        if action == "raise" and call != "clear_connector_metadata":
            raise FaultInjected(call, fired.step, self.rank)
        return fired.fault

    async def run(self, call: str) -> Fault | None:
        """An async call's fault: ``raise`` raises, ``hang`` sleeps ``hang_s`` (a
        deadline cuts it), ``cancel`` cancels the task; returns a ``corrupt`` fault."""
        fired = self.fire(call)
        if fired is None:
            return None
        action = fired.fault.action
        if action == "raise":
            raise FaultInjected(call, fired.step, self.rank)
        if action == "hang":
            await anyio.sleep(fired.fault.hang_s)
            return None
        if action == "cancel":
            await cancel_current_task(call, fired.step, self.rank)
        return fired.fault
