"""The connector's metadata of a planned step (``build_connector_meta``), attached to
its :class:`~pipeline.artifacts.SchedulerOutput`."""

from __future__ import annotations

import attrs

from pipeline.artifacts import SchedulerOutput
from pipeline.logger import get_logger
from pipeline.request import RequestStatus
from stages.scheduler.state import SchedulerState

__all__ = ["with_connector_metadata"]

log = get_logger()


def with_connector_metadata(state: SchedulerState, output: SchedulerOutput) -> SchedulerOutput:
    """``output`` with the connector's ``build_connector_meta(output)`` attached as
    ``kv_connector_metadata`` (``output`` itself without a connector).

    When ``build_connector_meta`` raises, the step's requests fail alone (their outputs
    come with the next update, from ``state.pending_outputs``) and the step runs empty,
    without metadata.
    """
    connector = state.connector
    if connector is None:
        return output
    try:
        metadata = connector.build_connector_meta(output)
    except Exception as exc:
        return _drop_step(state, output, exc)
    return attrs.evolve(output, kv_connector_metadata=metadata)


def _drop_step(state: SchedulerState, output: SchedulerOutput, exc: Exception) -> SchedulerOutput:
    log.error("connector build_connector_meta failed", step_id=output.step_id, error=repr(exc))
    ids = [item.req_id for item in output.requests]
    error = f"connector build_connector_meta failed: {exc!r}"
    for req_id in ids:
        state.kv.uncache_step_blocks(req_id)
    state.pending_outputs.extend(state.finish_all(ids, RequestStatus.FINISHED_ERROR, error))
    return attrs.evolve(
        output, requests=(), finished_req_ids=output.finished_req_ids | frozenset(ids)
    )
