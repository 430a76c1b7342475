"""``FaultyConnector`` (registered as ``"faulty"``): any connector, with injected faults.

It wraps any registered connector (both halves), forwards every call to it, and injects
the configured :class:`~connectors.testing.fault_spec.Fault` s at a chosen call, step and rank::

    EngineConfig(connector="faulty", connector_options={
        "inner": "recording", "inner_options": {},
        "faults": [{"call": "wait_for_save", "action": "raise", "step": 3, "rank": 1}],
    })

The inner halves are built with the wrapper's context (fingerprint, block size, rank and
world size) and ``inner_options`` as their options, and their answers come back as they
are unless a ``corrupt`` fault fires (``request_finished``'s ``delay_free`` and
``kv_transfer_params`` included), so it wraps ``nixl`` too: ``{"inner": "nixl",
"inner_options": {"role": "consumer", "port": 5700}}``.

A fault matches a call when ``call`` names it and ``step`` / ``rank`` / ``layer`` (each
``None``: any) agree. The step of a call is the ``step_id`` bound in structlog's
contextvars: the engine binds it for every step on both sides, worker threads included
(``None`` outside a step: ``register_kv_caches``, ``has_pending_work``, ``aclose``).
The rank is ``ConnectorContext.rank`` (0 on the scheduler half). A fault fires at most
``times`` times per rank. Actions (the calls allowing each: ``fault_spec.CALLS``):

* ``"raise"`` (any call): :class:`~pipeline.errors.FaultInjected` instead of the call.
  ``clear_connector_metadata`` raises *after* the inner clear: clear must never leave
  metadata bound, so the fault models a clear that reports a failure. At a save-side
  call (``save_kv_layer``, ``wait_for_save``, ``get_finished``) the engine takes it as
  a failed save, never a failed step: the inner half was not called, so a write it
  queued before may still land (a whole value, never confirmed nor announced).
* ``"hang"``: wait ``hang_s``, then forward. Async calls ``await anyio.sleep`` (a
  deadline cuts it). The per-layer hooks run in the forward thread, which cannot be
  cancelled: they ``time.sleep(min(hang_s, MAX_SYNC_HANG_S))`` and delay the step by
  that much. Other synchronous calls run on the event loop, where nothing could cut a
  hang: refused.
* ``"cancel"`` (async calls): a native ``task.cancel()`` of the running asyncio task,
  landing at the next await. Under trio it raises ``FaultInjected`` instead.
* ``"corrupt"`` (calls that return data): forward, then corrupt the answer:

  - ``get_finished``: adds an unknown id ``"faulty-unknown-<step>"`` and this step's
    ``finished_req_ids`` (requests the scheduler already ended) to both sets;
  - ``get_block_ids_with_load_errors``: adds the block ids that the step's
    SchedulerOutput lists for its first request listing any (the whole table of a
    request that is new this step, else the blocks appended to it this step);
  - ``wait_for_save``: reports every request of the step as a failed save;
  - ``get_num_new_matched_tokens``: claims a block more than the request has, loaded
    synchronously; the scheduler clamps it to leave one token to compute, and that
    request's tokens come from KV nobody loaded (garbage in, garbage out, no leak);
  - ``build_connector_meta``: returns the metadata built on the previous call (stale;
    unchanged on the first call);
  - ``has_pending_work``: claims pending work (the engine runs an extra idle step).

  Not offered: ``request_finished`` with ``delay_free`` and async loads that never
  complete: the scheduler would wait forever for a ``finished_sending`` /
  ``finished_recving`` that never comes (there is no lease on connector promises).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
    RequestFinishedResult,
    WorkerFinished,
)
from connectors.options import options_scope, options_where
from connectors.registry import create_connector, register_connector
from connectors.testing.fault_spec import (
    FaultInjector,
    FiredFault,
    current_step_id,
    parse_faulty_options,
)
from pipeline.errors import FaultInjected

if TYPE_CHECKING:
    import torch

    from connectors.base import KVConnectorOutput
    from pipeline.artifacts import KVStats, LoadFailures, SchedulerOutput
    from pipeline.kv_events.sink import KVEventSink
    from pipeline.request import Request

__all__ = ["FaultyConnector"]


def _setup(context: ConnectorContext) -> tuple[str, ConnectorContext, FaultInjector]:
    options = parse_faulty_options(context.options)
    inner_ctx = attrs.evolve(context, options=options.inner_options)
    return (
        options.inner,
        inner_ctx,
        FaultInjector(options.faults, context.rank, FaultyConnector.record),
    )


class FaultyConnector:
    """Namespace of the fault-injecting wrapper: its two halves and the firing record.

    ``FaultyConnector.fired`` lists every fault that fired, in order (all halves, all
    ranks, all engines); :meth:`reset` empties it. Both halves expose the wrapped half
    as ``inner``. Building a half raises ``InvalidConfigError`` for bad
    ``connector_options`` and ``UnknownConnectorError`` for an unknown ``inner``.
    """

    fired: ClassVar[list[FiredFault]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def record(cls, fired: FiredFault) -> None:
        """Append to :attr:`fired`; thread-safe, never blocks for long."""
        with cls._lock:
            cls.fired.append(fired)

    @classmethod
    def reset(cls) -> None:
        """Empty :attr:`fired` in place."""
        with cls._lock:
            cls.fired.clear()

    class Scheduler(KVConnectorScheduler):
        """Scheduler half: applies its faults, then forwards to the inner half."""

        def __init__(self, context: ConnectorContext) -> None:
            super().__init__(context)
            name, inner_ctx, self._faults = _setup(context)
            with options_scope(f"{options_where()}['inner_options']"):
                self.inner = create_connector(name, "scheduler", inner_ctx)
            self._last_meta: KVConnectorMetadata | None = None

        def get_num_new_matched_tokens(
            self, request: Request, num_computed_tokens: int
        ) -> MatchResult:
            """Forward; ``corrupt`` claims a block more than the request has."""
            fault = self._faults.sync("get_num_new_matched_tokens")
            result = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
            if fault is None:
                return result
            return MatchResult(request.num_tokens + self.context.block_size, False)

        def update_state_after_alloc(
            self, request: Request, block_ids: Sequence[int], num_external_tokens: int
        ) -> None:
            """Forward."""
            self._faults.sync("update_state_after_alloc")
            self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
            """Forward; ``corrupt`` returns the previous call's metadata (stale)."""
            fault = self._faults.sync("build_connector_meta")
            meta = self.inner.build_connector_meta(scheduler_output)
            stale, self._last_meta = self._last_meta, meta
            return stale if fault is not None and stale is not None else meta

        def request_finished(
            self, request: Request, block_ids: Sequence[int]
        ) -> RequestFinishedResult:
            """Forward."""
            self._faults.sync("request_finished")
            return self.inner.request_finished(request, block_ids)

        def update_connector_output(self, output: KVConnectorOutput) -> None:
            """Forward."""
            self._faults.sync("update_connector_output")
            self.inner.update_connector_output(output)

        def has_pending_work(self) -> bool:
            """Forward; ``corrupt`` claims pending work."""
            fault = self._faults.sync("has_pending_work")
            return self.inner.has_pending_work() or fault is not None

        def set_kv_event_sink(self, sink: KVEventSink) -> None:
            """Forward (no fault is offered: it runs once, while the engine is built)."""
            self.inner.set_kv_event_sink(sink)

    class Worker(KVConnectorWorker):
        """Worker half: applies its faults, then forwards to the inner half.

        The engine puts this half inside the lifecycle guard, so the guard checks the
        calls as the engine makes them, faulty or not. ``connector_metadata`` is the
        inner half's. Thread-safety is the inner half's (the injector has a lock).
        """

        def __init__(self, context: ConnectorContext) -> None:
            super().__init__(context)
            name, inner_ctx, self._faults = _setup(context)
            with options_scope(f"{options_where()}['inner_options']"):
                self.inner = create_connector(name, "worker", inner_ctx)
            self._forward: ForwardContext | None = None  # this step's, from start_load_kv

        @property
        def connector_metadata(self) -> KVConnectorMetadata | None:
            """The inner half's bound metadata, ``None`` between steps."""
            return self.inner.connector_metadata

        def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
            """Forward."""
            self._faults.sync("register_kv_caches")
            self.inner.register_kv_caches(kv_caches)

        def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
            """Forward (after a ``raise`` nothing is bound)."""
            self._faults.sync("bind_connector_metadata")
            self.inner.bind_connector_metadata(metadata)

        def clear_connector_metadata(self) -> None:
            """Forward; a ``raise`` fault raises after the inner clear ran."""
            self._forward = None
            try:
                self.inner.clear_connector_metadata()
            finally:
                if self._faults.sync("clear_connector_metadata") is not None:
                    raise FaultInjected(
                        "clear_connector_metadata", current_step_id(), self.context.rank
                    )

        async def start_load_kv(self, ctx: ForwardContext) -> None:
            """Remember the step's ForwardContext (``corrupt`` reads it); forward."""
            self._forward = ctx
            await self._faults.run("start_load_kv")
            await self.inner.start_load_kv(ctx)

        def wait_for_layer_load(self, layer: int) -> None:
            """Forward; forward thread."""
            self._faults.sync("wait_for_layer_load", layer)
            self.inner.wait_for_layer_load(layer)

        def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
            """Forward; forward thread."""
            self._faults.sync("save_kv_layer", layer)
            self.inner.save_kv_layer(layer, kv_layer, ctx)

        def _scheduler_output(self) -> SchedulerOutput | None:
            return self._forward.scheduler_output if self._forward is not None else None

        async def wait_for_save(self) -> frozenset[str]:
            """Forward; ``corrupt`` reports every request of the step as a failed save."""
            fault = await self._faults.run("wait_for_save")
            failed = frozenset(await self.inner.wait_for_save())
            so = self._scheduler_output()
            if fault is None or so is None:
                return failed
            return failed | {r.req_id for r in so.requests}

        async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
            """Forward; ``corrupt`` adds an unknown id and the already-finished ids."""
            fault = await self._faults.run("get_finished")
            result = await self.inner.get_finished(finished_req_ids)
            if fault is None:
                return result
            bogus = {f"faulty-unknown-{current_step_id()}", *finished_req_ids}
            return WorkerFinished(
                sending=frozenset(result.sending) | bogus,
                recving=frozenset(result.recving) | bogus,
            )

        def get_block_ids_with_load_errors(self) -> frozenset[int]:
            """Forward; ``corrupt`` adds the first listed request's block ids."""
            fault = self._faults.sync("get_block_ids_with_load_errors")
            errors = frozenset(self.inner.get_block_ids_with_load_errors())
            so = self._scheduler_output()
            if fault is None or so is None:
                return errors
            return errors | frozenset(next((r.block_ids for r in so.requests if r.block_ids), ()))

        def get_load_failures(self) -> LoadFailures | None:
            """Forward (the blocks a ``corrupt`` fault adds have no cause: ``unknown``)."""
            return self.inner.get_load_failures()

        def get_kv_stats(self) -> KVStats:
            """Forward."""
            self._faults.sync("get_kv_stats")
            return self.inner.get_kv_stats()

        async def aclose(self) -> None:
            """Forward."""
            await self._faults.run("aclose")
            await self.inner.aclose()


register_connector("faulty", FaultyConnector.Scheduler, FaultyConnector.Worker)
