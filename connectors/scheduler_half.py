"""The scheduler half of a connector (:mod:`connectors.base` is the map of the API)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pipeline.artifacts import SchedulerOutput
    from pipeline.kv_events.sink import KVEventSink
    from pipeline.request import Request

from connectors.types import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    MatchResult,
    RequestFinishedResult,
)

__all__ = [
    "KVConnectorScheduler",
]


class KVConnectorScheduler(abc.ABC):
    """Scheduler half: decides what each step loads and saves, and when blocks are freed.

    One instance per engine, built by :func:`connectors.registry.create_connector` with
    the engine's :class:`ConnectorContext` (``rank`` 0). Every call comes from the
    engine process, on the thread of its event loop, one at a time (the scheduler half
    need not be thread-safe) and never concurrently with a step's ``schedule`` or
    ``update`` stage. No call is ``async`` and none may block on I/O for long: a slow
    lookup answers ``MatchResult(None)`` (ask again next step) or loads with
    ``load_async``. A call that raises is contained: the method's ``Raises`` section says
    what fails (a request, a step's metadata, a log line); the engine keeps serving.
    """

    role: ClassVar[KVConnectorRole] = KVConnectorRole.SCHEDULER

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context

    def check_request(self, request: Request) -> None:  # noqa: B027
        """Refuse a request the connector will not serve, before it is queued.

        Called once per request when the engine admits it (``EngineCore.add_request``),
        before the scheduler sees it: what raises here reaches the caller at once (an
        HTTP 400), and nothing of the request was scheduled. For checks of what comes
        from outside (``kv_transfer_params``). Engine process, event loop; synchronous,
        must not block. The default accepts every request.

        Raises:
            InvalidRequestError: The request is refused; the message names the field.
        """

    def release_transfer(self, kv_transfer_params: dict[str, Any]) -> bool:
        """Free at once what this engine holds for the transfer ``kv_transfer_params``
        describe (as it answered them from ``request_finished``), because its receiver
        will never take it (a consumer refused the request); whether anything is freed.

        Called by whoever routed the transfer (``AsyncEngine.release_transfer``, the
        server's ``POST /v1/kv_transfer/release``, which a proxy calls). The params come
        from outside: a connector frees only a transfer that they name exactly (e.g. by
        its ticket). Engine process, event loop; synchronous, must not block. The
        default holds nothing and frees nothing.
        """
        return False

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """Tokens beyond ``num_computed_tokens`` (the local prefix hit) the connector can load.

        Called by the scheduler in the ``schedule`` stage of the engine graph, once per
        scheduling attempt of a waiting request, before its blocks are allocated: a
        request that stays waiting (no room, or ``num_tokens`` was ``None``) is asked
        again on a later step. Engine process, event loop; synchronous, must not block
        (no await, so cancellation never lands inside it). A request whose async load
        finished is not asked again.

        Args:
            request: The waiting request; read-only, must not be mutated.
            num_computed_tokens: Tokens the local prefix cache already holds (whole
                blocks).

        Returns:
            ``MatchResult(num_tokens, load_async)``: ``num_tokens`` extra tokens the
            connector can load (whole blocks only; the scheduler clamps a synchronous
            load to leave the last prompt token to compute), or ``None`` when it cannot
            tell yet. ``load_async=True`` parks the request in
            ``WAITING_FOR_REMOTE_KVS`` until a rank's ``get_finished`` names it in
            ``recving``.

        Raises:
            Exception: Any exception fails this request alone (finish reason
                ``"error"``); the other requests are scheduled.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; remember which to load into.

        Called by the scheduler in the ``schedule`` stage right after a successful
        allocation for a waiting request, once per allocation, even when
        ``num_external_tokens`` is 0 (a request resumed after its async load finished is
        allocated again, with 0). Engine process, event loop; synchronous, must not
        block; cancellation cannot land inside it.

        Args:
            request: The request; read-only, must not be mutated.
            block_ids: Every block the request now holds, in order; read-only (the
                scheduler owns the block table).
            num_external_tokens: Tokens this connector will load into those blocks (the
                clamped answer of :meth:`get_num_new_matched_tokens`).

        Raises:
            Exception: Any exception fails this request alone (its blocks are freed,
                :meth:`request_finished` is called).
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's metadata for the worker halves and reset per-step state.

        Called by the scheduler at the end of the ``schedule`` stage, exactly once per
        step, including steps with nothing scheduled, after every
        :meth:`update_state_after_alloc` of the step. Engine process, event loop;
        synchronous, must not block; cancellation cannot land inside it.

        Args:
            scheduler_output: The step as planned; read-only, must not be mutated.

        Returns:
            The step's metadata. The same object goes to every in-process rank and its
            :meth:`~KVConnectorMetadata.to_bytes` to every worker process: it must not
            be mutated after it is returned, by either half.

        Raises:
            Exception: The step's requests fail (their outputs come with the next
                update) and the step runs empty, without metadata.
        """

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """A request finished; say whether its blocks must stay until its KV is sent.

        Called once per request when it leaves the scheduler, whatever the reason: a
        stop or length limit in the ``update`` stage, an abort, or a failure. Its blocks
        are still allocated during the call. Engine process, event loop; synchronous,
        must not block; cancellation cannot land inside it.

        Args:
            request: The finished request; read-only, must not be mutated.
            block_ids: The blocks it holds; read-only.

        Returns:
            ``RequestFinishedResult(delay_free, kv_transfer_params)``: with
            ``delay_free`` the blocks stay allocated until every rank reports the
            request in ``sending`` (or the transfer lease expires and
            :meth:`update_connector_output` lists it in ``expired_sending``);
            ``kv_transfer_params`` travel with the request's final output. The default
            frees at once and returns no params.

        Raises:
            Exception: Logged; the blocks are freed at once.
        """
        return RequestFinishedResult()

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """Receive the worker results of a step, merged over every rank.

        Called by the scheduler in the ``update`` stage, once per step that reached
        fan-in, after the step's tokens and finished transfers were applied. Engine
        process, event loop; synchronous, must not block; cancellation cannot land
        inside it. The default does nothing.

        Args:
            output: Transfers every rank finished, transfers expired under the fan-in
                lease, blocks that failed to load, requests whose save failed;
                immutable.

        Raises:
            Exception: Logged; the step's outputs are kept.
        """

    def has_pending_work(self) -> bool:
        """Whether transfers are still in flight; the engine keeps stepping until not.

        Called by the engine loop between steps, whenever it decides whether another
        step would make progress (at least once per step): must be cheap. Engine
        process, event loop; synchronous, must not block; a query, it should not change
        state.

        Returns:
            ``True`` while the connector waits for work that only more steps complete
            (delayed frees, async loads or saves); the default is ``False``.

        Raises:
            Exception: Logged and read as ``False`` (drained).
        """
        return False

    def set_kv_event_sink(self, sink: KVEventSink) -> None:  # noqa: B027
        """Report the blocks this connector's tiers cache and evict into ``sink``.

        Called by the engine once, while it is built and before its first step, and only
        when KV events are on (``EngineConfig.kv_events``): with events off it is never
        called and a connector makes no event. Engine process, event loop; synchronous,
        must not block; cancellation cannot land inside it. The default does nothing (the
        connector publishes no events).

        A tier that publishes derives its own sink with ``sink.for_medium(medium)`` (its
        events then join the block pool's in the step's batch, in order) and reports a
        hash stored only once the tier really holds its block (a save confirmed by the
        step's output, not merely scheduled), and removed when it evicts or invalidates
        it, so that an index rebuilt from the events equals what the tier holds. A
        connector that wraps others forwards the call to each of them.

        Args:
            sink: The engine's sink (the device tier's; its ``block_size`` and hash
                format are the engine's).

        Raises:
            Exception: The engine is not built (a configuration error).
        """
