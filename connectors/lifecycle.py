"""The lifecycle guard: checks the per-step order of every worker-side connector call.

Per step, on each rank::

    begin_step → bind_connector_metadata → start_load_kv
               → (wait_for_layer_load | save_kv_layer)*
               → wait_for_save → get_finished → clear_connector_metadata

``clear_connector_metadata`` may follow any call of the step (a step that failed early
still clears) but only once; nothing but the next ``begin_step`` or ``aclose`` may follow
it. A step that never cleared refuses the next ``begin_step``: that is stale metadata
leaking into the next step, the bug class kvstep exists to prevent.

The check is a lookup in a table precomputed at import (call and state are small ints);
nothing is formatted unless a call is refused. State changes happen under a lock so the
per-layer hooks may run on the forward thread while the event loop drives the step-level
calls; the hooks after the first of a step only read the state (no lock), which keeps
them to a few tens of nanoseconds.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from connectors.base import ForwardContext, KVConnectorMetadata, KVConnectorWorker, WorkerFinished
from pipeline.errors import ConnectorLifecycleError

if TYPE_CHECKING:
    import torch

    from pipeline.artifacts import KVStats, LoadFailures

__all__ = ["ALLOWED_PREVIOUS", "GuardedWorker", "make_worker"]

# One small int per call; the guard's state is the last state-changing call.
_CALLS = (
    "(none)",  # nothing yet since construction
    "register_kv_caches",
    "begin_step",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "clear_connector_metadata",
    "aclose",
    "get_block_ids_with_load_errors",
    "get_kv_stats",
    "get_load_failures",
    "(layer hooks)",  # state only: inside the layer hooks; ``_hook`` says which
)
(
    _NONE,
    _REGISTER,
    _BEGIN,
    _BIND,
    _LOAD,
    _WAIT_LAYER,
    _SAVE_LAYER,
    _WAIT_SAVE,
    _FINISHED,
    _CLEAR,
    _ACLOSE,
    _LOAD_ERRORS,
    _KV_STATS,
    _LOAD_FAILURES,
    _LAYERS,
) = range(len(_CALLS))

_IN_STEP = frozenset({_BEGIN, _BIND, _LOAD, _LAYERS, _WAIT_SAVE, _FINISHED})
_AFTER_LOAD = frozenset({_LOAD, _LAYERS, _WAIT_SAVE, _FINISHED})
_IDLE = frozenset({_NONE, _REGISTER, _CLEAR})

# Allowed states before each call (the state is the last state-changing call, except that
# both layer hooks put the guard in the one state _LAYERS).
_PREVIOUS: dict[int, frozenset[int]] = {
    _REGISTER: frozenset({_NONE}),
    _BEGIN: _IDLE,
    _BIND: frozenset({_BEGIN}),
    _LOAD: frozenset({_BIND}),
    _LAYERS: frozenset({_LOAD, _LAYERS}),
    _WAIT_SAVE: frozenset({_LOAD, _LAYERS}),
    _FINISHED: frozenset({_WAIT_SAVE}),
    _CLEAR: _IN_STEP,
    _ACLOSE: _IDLE | {_ACLOSE},
    _LOAD_ERRORS: _AFTER_LOAD,
    _KV_STATS: _AFTER_LOAD,
    _LOAD_FAILURES: _AFTER_LOAD,
}
_PREVIOUS[_WAIT_LAYER] = _PREVIOUS[_SAVE_LAYER] = _PREVIOUS[_LAYERS]

# _OK[call][state]: the hot-path lookup (no hashing, no formatting).
_OK: tuple[tuple[bool, ...], ...] = tuple(
    tuple(state in _PREVIOUS.get(call, frozenset()) for state in range(len(_CALLS)))
    for call in range(len(_CALLS))
)


def _names(states: frozenset[int]) -> frozenset[str]:
    hooks = {_CALLS[_WAIT_LAYER], _CALLS[_SAVE_LAYER]} if _LAYERS in states else set()
    return frozenset({_CALLS[s] for s in states if s != _LAYERS} | hooks)


ALLOWED_PREVIOUS: Mapping[str, frozenset[str]] = MappingProxyType(
    {_CALLS[call]: _names(prev) for call, prev in _PREVIOUS.items() if call != _LAYERS}
)
"""For each worker-side call, the calls it may directly follow (``"(none)"``: nothing yet).

The three queries (``get_block_ids_with_load_errors``, ``get_load_failures``,
``get_kv_stats``) do not change the state, so they never count as a previous call themselves.
"""


class GuardedWorker(KVConnectorWorker):
    """A :class:`KVConnectorWorker` that checks the per-step call order, then forwards.

    Every worker method has the wrapped connector's signature (async stays async) and
    raises :class:`~pipeline.errors.ConnectorLifecycleError`, naming the step id, the
    call and the previous call, instead of forwarding a call that is out of order. A
    refused call changes nothing. A call that is allowed counts as made even if the
    wrapped connector then raises or is cancelled, so the finalizer's clear is allowed.

    Thread-safety: every state change is atomic, so the per-layer hooks may run on one
    forward thread per rank while the event loop drives the step-level calls. A layer
    hook that starts after a clear is refused; one already past its check when a clear
    lands (a step cancelled mid-forward) still reaches the wrapped connector.
    """

    def __init__(self, inner: KVConnectorWorker) -> None:
        """Wrap ``inner``; the guard starts before the first step.

        Args:
            inner: The connector to guard. Its ``context`` is shared, not copied.
        """
        super().__init__(inner.context)
        self._inner = inner
        self._lock = threading.Lock()
        self._last = _NONE  # the state: the last state-changing call, or _LAYERS
        self._hook = _WAIT_LAYER  # which layer hook came last, while in _LAYERS
        self._step_id: int | None = None

    # -- guard state -------------------------------------------------------------

    @property
    def inner(self) -> KVConnectorWorker:
        """The wrapped connector."""
        return self._inner

    @property
    def step_id(self) -> int | None:
        """The current step, or the last one after its clear; ``None`` before any."""
        return self._step_id

    @property
    def last_call(self) -> str | None:
        """Name of the last state-changing call (queries excluded); ``None`` before any."""
        return None if self._last == _NONE else _CALLS[self._name_of(self._last)]

    @property
    def connector_metadata(self) -> KVConnectorMetadata | None:
        """The wrapped connector's bound metadata (not checked)."""
        return self._inner.connector_metadata

    # acquire()/release() rather than ``with``: about half the cost on CPython 3.11.
    def _enter(self, call: int) -> None:
        self._lock.acquire()
        try:
            previous = self._last
            allowed = _OK[call][previous]
            if allowed:
                self._last = call
        finally:
            self._lock.release()
        if not allowed:
            raise self._refusal(call, previous)

    def _enter_layers(self, hook: int) -> None:
        # Slow path of the layer hooks: the first hook of a step, or a refusal. The fast
        # path (already in the hooks) is inlined in the hooks and only reads the state.
        self._lock.acquire()
        try:
            previous = self._last
            allowed = _OK[_LAYERS][previous]
            if allowed:
                self._hook = hook
                self._last = _LAYERS
        finally:
            self._lock.release()
        if not allowed:
            raise self._refusal(hook, previous)

    def _name_of(self, state: int) -> int:
        return self._hook if state == _LAYERS else state

    def _refusal(self, call: int, previous: int) -> ConnectorLifecycleError:
        allowed = sorted(ALLOWED_PREVIOUS[_CALLS[call]])
        return ConnectorLifecycleError(
            self._step_id, _CALLS[call], _CALLS[self._name_of(previous)], allowed
        )

    def begin_step(self, step_id: int) -> None:
        """Open step ``step_id``; called by the ``bind`` stage, first in every step.

        Allowed before the first step and after the previous step's clear. Synchronous,
        never blocks; thread-safe.

        Raises:
            ConnectorLifecycleError: The previous step never cleared, or after ``aclose``.
        """
        self._lock.acquire()
        try:
            previous = self._last
            allowed = _OK[_BEGIN][previous]
            if allowed:
                self._last = _BEGIN
                self._step_id = step_id
        finally:
            self._lock.release()
        if not allowed:
            raise self._refusal(_BEGIN, previous)

    # -- forwarded connector API -------------------------------------------------

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Forward once, before the first step (see :class:`KVConnectorWorker`)."""
        self._enter(_REGISTER)
        self._inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Forward right after ``begin_step``. Synchronous, never blocks."""
        self._enter(_BIND)
        self._inner.bind_connector_metadata(metadata)

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Forward right after ``bind_connector_metadata``. Cancellation-safe."""
        self._enter(_LOAD)
        await self._inner.start_load_kv(ctx)

    def wait_for_layer_load(self, layer: int) -> None:
        """Forward after ``start_load_kv`` or another layer hook. Forward thread."""
        if self._last != _LAYERS:
            self._enter_layers(_WAIT_LAYER)
        self._hook = _WAIT_LAYER
        self._inner.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Forward after ``start_load_kv`` or another layer hook. Forward thread."""
        if self._last != _LAYERS:
            self._enter_layers(_SAVE_LAYER)
        self._hook = _SAVE_LAYER
        self._inner.save_kv_layer(layer, kv_layer, ctx)

    async def wait_for_save(self) -> frozenset[str]:
        """Forward after ``start_load_kv`` or the last layer hook."""
        self._enter(_WAIT_SAVE)
        return await self._inner.wait_for_save()

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """Forward right after ``wait_for_save``."""
        self._enter(_FINISHED)
        return await self._inner.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Query, allowed from ``start_load_kv`` until the clear; does not change state."""
        if not _OK[_LOAD_ERRORS][self._last]:
            raise self._refusal(_LOAD_ERRORS, self._last)
        return self._inner.get_block_ids_with_load_errors()

    def get_kv_stats(self) -> KVStats:
        """Query, allowed from ``start_load_kv`` until the clear; does not change state."""
        if not _OK[_KV_STATS][self._last]:
            raise self._refusal(_KV_STATS, self._last)
        return self._inner.get_kv_stats()

    def get_load_failures(self) -> LoadFailures | None:
        """Query, allowed from ``start_load_kv`` until the clear; does not change state."""
        if not _OK[_LOAD_FAILURES][self._last]:
            raise self._refusal(_LOAD_FAILURES, self._last)
        return self._inner.get_load_failures()

    def clear_connector_metadata(self) -> None:
        """Forward exactly once per step, from any point after ``begin_step``.

        Synchronous and never blocks, so it can sit in the innermost ``finally``.

        Raises:
            ConnectorLifecycleError: A second clear in the step, or no step is open.
        """
        self._enter(_CLEAR)
        self._inner.clear_connector_metadata()

    async def aclose(self) -> None:
        """Close the wrapped connector, outside a step; a second call is a no-op.

        The guard counts as closed before the wrapped ``aclose`` runs, so a failing or
        cancelled close is never retried and every later call is refused.

        Raises:
            ConnectorLifecycleError: Called inside a step (after ``begin_step``, before
                its clear).
        """
        self._lock.acquire()
        try:
            previous = self._last
            allowed = _OK[_ACLOSE][previous]
            if allowed:
                self._last = _ACLOSE
        finally:
            self._lock.release()
        if previous == _ACLOSE:
            return
        if not allowed:
            raise self._refusal(_ACLOSE, previous)
        await self._inner.aclose()

    def __repr__(self) -> str:
        return (
            f"GuardedWorker({self._inner!r}, step_id={self._step_id}, last_call={self.last_call!r})"
        )


def make_worker(worker: KVConnectorWorker, enabled: bool = True) -> KVConnectorWorker:
    """Return ``worker`` behind the lifecycle guard, or ``worker`` itself when disabled.

    A worker that is already guarded is returned as is (never guarded twice).

    Args:
        worker: The connector's worker half.
        enabled: Whether to check the call order (on by default).
    """
    if not enabled or isinstance(worker, GuardedWorker):
        return worker
    return GuardedWorker(worker)
