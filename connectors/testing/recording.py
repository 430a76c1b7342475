"""``RecordingConnector`` (registered as ``"recording"``): records every call of both halves.

``RecordingConnector.calls`` is one class-level list shared by every instance of both
halves (all ranks of an in-process engine), in call order. Each entry is a
:class:`ConnectorCall` whose ``step_id`` comes from structlog's contextvars (the engine
binds ``step_id`` for each step, worker threads included) and whose ``rank`` comes from
the half's :class:`~connectors.base.ConnectorContext`. :func:`~connectors.testing.check_lifecycle`
(``lifecycle_check``) turns a list of calls into the list of per-step order violations
(empty when all is well)::

    RecordingConnector.reset()
    ...run an engine with connector="recording"...
    assert check_lifecycle(RecordingConnector.calls) == []
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import structlog

from connectors.base import (
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
    RequestFinishedResult,
    WorkerFinished,
)
from connectors.registry import register_connector
from pipeline.artifacts import KVStats

if TYPE_CHECKING:
    import torch

    from connectors.base import KVConnectorOutput
    from pipeline.artifacts import SchedulerOutput
    from pipeline.request import Request

__all__ = [
    "ConnectorCall",
    "RecordingConnector",
    "RecordingMetadata",
]


@attrs.frozen(kw_only=True)
class ConnectorCall:
    """One recorded connector call.

    Attributes:
        role: ``"scheduler"`` or ``"worker"``.
        rank: The half's rank (``context.rank``; 0 on the scheduler).
        step_id: ``step_id`` bound in structlog's contextvars at the call, if any.
        method: The connector method's name.
        req_id: The request, for per-request calls.
        req_ids: The requests a per-step call is about (metadata, finished sets).
        layer: The layer, for the per-layer hooks.
        num_tokens: ``num_computed_tokens`` / ``num_external_tokens``, where passed.
        meta_step_id: For ``bind_connector_metadata``: the step the metadata was built
            for (a mismatch with ``step_id`` is stale metadata).
    """

    role: Literal["scheduler", "worker"]
    rank: int
    step_id: int | None
    method: str
    req_id: str | None = None
    req_ids: tuple[str, ...] = ()
    layer: int | None = None
    num_tokens: int | None = None
    meta_step_id: int | None = None


@attrs.frozen
class RecordingMetadata(KVConnectorMetadata):
    """The recording connector's metadata: the step and its scheduled requests."""

    step_id: int
    req_ids: tuple[str, ...] = ()


def _record(
    role: Literal["scheduler", "worker"], rank: int, method: str, details: dict[str, Any]
) -> None:
    step_id = structlog.contextvars.get_contextvars().get("step_id")
    call = ConnectorCall(
        role=role,
        rank=rank,
        step_id=step_id if isinstance(step_id, int) else None,
        method=method,
        **details,
    )
    RecordingConnector.record(call)


class RecordingConnector:
    """Namespace of the recording connector: its two halves and the shared call list.

    Thread-safety: records are appended under a lock, so the per-layer hooks may run
    on forward threads of several ranks at once.
    """

    calls: ClassVar[list[ConnectorCall]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def record(cls, call: ConnectorCall) -> None:
        """Append ``call`` to :attr:`calls`; thread-safe, never blocks for long."""
        with cls._lock:
            cls.calls.append(call)

    @classmethod
    def reset(cls) -> None:
        """Empty :attr:`calls` (in place: references to the list stay valid)."""
        with cls._lock:
            cls.calls.clear()

    @classmethod
    def scheduler_calls(cls, step_id: int | None = None) -> list[ConnectorCall]:
        """The scheduler half's calls, optionally only those of ``step_id``."""
        with cls._lock:
            calls = list(cls.calls)
        return [
            c for c in calls if c.role == "scheduler" and (step_id is None or c.step_id == step_id)
        ]

    @classmethod
    def worker_calls(
        cls, rank: int | None = None, step_id: int | None = None
    ) -> list[ConnectorCall]:
        """The worker half's calls, optionally only those of ``rank`` and/or ``step_id``."""
        with cls._lock:
            calls = list(cls.calls)
        return [
            c
            for c in calls
            if c.role == "worker"
            and (rank is None or c.rank == rank)
            and (step_id is None or c.step_id == step_id)
        ]

    @classmethod
    def steps(cls) -> list[int]:
        """The distinct step ids seen in any call, ascending."""
        with cls._lock:
            return sorted({c.step_id for c in cls.calls if c.step_id is not None})

    @classmethod
    def methods(cls, rank: int | None = None, step_id: int | None = None) -> list[str]:
        """The worker methods called (in order), filtered like :meth:`worker_calls`."""
        return [c.method for c in cls.worker_calls(rank, step_id)]

    class Scheduler(KVConnectorScheduler):
        """Scheduler half: claims no external KV; records every call."""

        def _record(self, method: str, **details: object) -> None:
            _record("scheduler", self.context.rank, method, details)

        def get_num_new_matched_tokens(
            self, request: Request, num_computed_tokens: int
        ) -> MatchResult:
            """Record; no external KV: ``MatchResult(0, False)``."""
            self._record(
                "get_num_new_matched_tokens",
                req_id=request.request_id,
                num_tokens=num_computed_tokens,
            )
            return MatchResult(0, False)

        def update_state_after_alloc(
            self, request: Request, block_ids: Sequence[int], num_external_tokens: int
        ) -> None:
            """Record."""
            self._record(
                "update_state_after_alloc",
                req_id=request.request_id,
                num_tokens=num_external_tokens,
            )

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RecordingMetadata:
            """Record; the metadata names the step and its scheduled requests."""
            req_ids = tuple(r.req_id for r in scheduler_output.requests)
            self._record("build_connector_meta", req_ids=req_ids)
            return RecordingMetadata(scheduler_output.step_id, req_ids)

        def request_finished(
            self, request: Request, block_ids: Sequence[int]
        ) -> RequestFinishedResult:
            """Record; never delays the free."""
            self._record("request_finished", req_id=request.request_id)
            return RequestFinishedResult()

        def update_connector_output(self, output: KVConnectorOutput) -> None:
            """Record (``req_ids``: finished sending and receiving)."""
            done = output.finished_sending | output.finished_recving
            self._record("update_connector_output", req_ids=tuple(sorted(done)))

        def has_pending_work(self) -> bool:
            """Record; nothing is ever pending."""
            self._record("has_pending_work")
            return False

    class Worker(KVConnectorWorker):
        """Worker half: moves nothing; records every call, keeps base-class behaviour."""

        def _record(self, method: str, **details: object) -> None:
            _record("worker", self.context.rank, method, details)

        def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
            """Record."""
            self._record("register_kv_caches")

        def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
            """Record (with the metadata's step and requests when it is ours); bind."""
            if isinstance(metadata, RecordingMetadata):
                self._record(
                    "bind_connector_metadata",
                    req_ids=metadata.req_ids,
                    meta_step_id=metadata.step_id,
                )
            else:
                self._record("bind_connector_metadata")
            super().bind_connector_metadata(metadata)

        def clear_connector_metadata(self) -> None:
            """Record; clear (metadata is ``None`` afterwards)."""
            self._record("clear_connector_metadata")
            super().clear_connector_metadata()

        async def start_load_kv(self, ctx: ForwardContext) -> None:
            """Record."""
            self._record("start_load_kv")

        def wait_for_layer_load(self, layer: int) -> None:
            """Record with the layer; forward thread."""
            self._record("wait_for_layer_load", layer=layer)

        def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
            """Record with the layer; forward thread."""
            self._record("save_kv_layer", layer=layer)

        async def wait_for_save(self) -> frozenset[str]:
            """Record; no save ever fails."""
            self._record("wait_for_save")
            return frozenset()

        async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
            """Record (``req_ids``: the finished requests); nothing is in flight."""
            self._record("get_finished", req_ids=tuple(sorted(finished_req_ids)))
            return WorkerFinished()

        def get_block_ids_with_load_errors(self) -> frozenset[int]:
            """Record; no load ever fails."""
            self._record("get_block_ids_with_load_errors")
            return frozenset()

        def get_kv_stats(self) -> KVStats:
            """Record; no traffic."""
            self._record("get_kv_stats")
            return KVStats()

        async def aclose(self) -> None:
            """Record."""
            self._record("aclose")


register_connector("recording", RecordingConnector.Scheduler, RecordingConnector.Worker)
