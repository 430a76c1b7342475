"""``check_lifecycle``: a record of connector calls turned into the per-step order
violations it shows, checked against the guard's own table
(:data:`connectors.lifecycle.ALLOWED_PREVIOUS`)."""

from __future__ import annotations

from collections.abc import Iterable

from connectors.lifecycle import ALLOWED_PREVIOUS
from connectors.testing.recording import ConnectorCall

__all__ = ["check_lifecycle"]

_IDLE = frozenset({None, "register_kv_caches", "clear_connector_metadata"})
_STEP_OPENERS = frozenset({"bind_connector_metadata", "clear_connector_metadata"})
_QUERIES = frozenset({"get_block_ids_with_load_errors", "get_kv_stats"})


def check_lifecycle(calls: Iterable[ConnectorCall]) -> list[str]:
    """The per-step order violations among the worker calls of ``calls``; ``[]`` if none.

    Checks, per rank, the guard's order (:data:`connectors.lifecycle.ALLOWED_PREVIOUS`):
    bind → start_load_kv → layer hooks → wait_for_save → get_finished → clear, clear
    exactly once per step, nothing after clear but the next step, every step cleared,
    and bound metadata built for the step it is bound in. A step starts at a bind (or at
    a clear, for a step that failed before binding) after the previous step's clear; a
    change of ``step_id`` before the clear is a step that never cleared. Scheduler
    calls are ignored. Without step ids (nothing bound in contextvars) two clears in a
    row count as a double clear. Pure function. Inside a step the state advances past a
    violation, so one missing call is reported once; a stray call outside a step opens
    none.
    """
    problems: list[str] = []
    last: dict[int, str | None] = {}  # rank -> last state-changing method
    step: dict[int, int | None] = {}  # rank -> step of the open (or last) step
    cleared: dict[int, set[int | None]] = {}  # rank -> steps already cleared
    for call in calls:
        if call.role != "worker":
            continue
        rank, method, step_id = call.rank, call.method, call.step_id
        where = f"rank {rank} step {step_id}"
        prev = last.get(rank)
        if prev not in _IDLE and prev != "aclose" and step_id != step.get(rank):
            problems.append(
                f"rank {rank} step {step.get(rank)}: never cleared ({method} in step {step_id})"
            )
            prev = "clear_connector_metadata"
        if prev in _IDLE and method in _STEP_OPENERS:
            done = cleared.setdefault(rank, set())
            if (
                method == "clear_connector_metadata"
                and prev == method
                and (step_id is None or step_id in done)
            ):
                problems.append(f"{where}: cleared twice")
                continue
            if step_id is not None and step_id in done:
                problems.append(f"{where}: {method} after the step's clear")
                continue
            prev, step[rank] = "begin_step", step_id
        allowed = ALLOWED_PREVIOUS.get(method, frozenset())
        if (prev or "(none)") not in allowed:
            problems.append(f"{where}: {method} after {prev or '(none)'}")
            if prev in _IDLE or prev == "aclose":
                continue  # a stray call outside a step does not open one
        if method == "clear_connector_metadata":
            cleared.setdefault(rank, set()).add(step_id)
        elif call.meta_step_id is not None and step_id is not None and call.meta_step_id != step_id:
            problems.append(f"{where}: bound stale metadata of step {call.meta_step_id}")
        if method not in _QUERIES:
            last[rank] = method
    for rank, prev in last.items():
        if prev not in _IDLE and prev != "aclose":
            problems.append(f"rank {rank} step {step.get(rank)}: never cleared (after {prev})")
    return problems
