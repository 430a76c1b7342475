"""A test connector for ``kv_transfer_params``: records what its scheduler half is given,
and answers ``request_finished`` with params of its own.

``connector_options={"reply": ...}``: ``"echo"`` (default) answers
``{"remote_request_id": id, "got": <the request's params>}`` for a request that came with
params and ``None`` otherwise (as a producer answers only requests asking for a transfer);
``"bad"`` answers a non-JSON value (a NaN), which the engine drops.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs

from connectors.base import (
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
    RequestFinishedResult,
)
from connectors.registry import register_connector, unregister_connector
from pipeline.artifacts import SchedulerOutput
from pipeline.request import Request

NAME = "transfer-params-test"


@attrs.frozen
class Seen:
    """One call of the scheduler half: the request, and a snapshot of its params then."""

    method: str
    req_id: str
    params: Any
    same_object: bool = False  # the engine's dict is the one handed over earlier


@attrs.frozen
class EmptyMeta(KVConnectorMetadata):
    step_id: int = 0


class TransferScheduler(KVConnectorScheduler):
    seen: ClassVar[list[Seen]] = []
    handed: ClassVar[list[Any]] = []  # objects callers passed (compared by identity)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        params = request.kv_transfer_params
        same = any(params is obj for obj in TransferScheduler.handed)
        snapshot = copy.deepcopy(params)
        TransferScheduler.seen.append(Seen("match", request.request_id, snapshot, same))
        return MatchResult(0)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EmptyMeta:
        return EmptyMeta(scheduler_output.step_id)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        params = request.kv_transfer_params
        TransferScheduler.seen.append(Seen("finished", request.request_id, copy.deepcopy(params)))
        reply = self.context.options.get("reply", "echo")
        if reply == "bad":
            return RequestFinishedResult(kv_transfer_params={"x": float("nan")})
        if params is None:
            return RequestFinishedResult()
        answer = {"remote_request_id": request.request_id, "got": params}
        return RequestFinishedResult(kv_transfer_params=answer)


class TransferWorker(KVConnectorWorker):
    """Does nothing: the params never leave the engine process."""


@contextmanager
def registered() -> Iterator[type[TransferScheduler]]:
    """The connector registered as :data:`NAME`, its records cleared, for a block."""
    register_connector(NAME, TransferScheduler, TransferWorker, replace=True)
    TransferScheduler.seen.clear()
    TransferScheduler.handed.clear()
    try:
        yield TransferScheduler
    finally:
        TransferScheduler.seen.clear()
        TransferScheduler.handed.clear()
        unregister_connector(NAME)
