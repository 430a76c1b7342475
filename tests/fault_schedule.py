"""What the fault-schedule tests share (not a test file): a client's view of its request,
and the invariants checked after an engine ran a random fault schedule.

Used by ``tests/pipeline/test_faults_engine.py`` (one engine, ``faulty`` around
``recording``) and ``tests/connectors/test_nixl_faults.py`` (a producer/consumer pair,
``faulty`` around ``nixl``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import attrs

from connectors.testing import ConnectorCall
from pipeline import AsyncEngine, RequestOutput
from pipeline.errors import StepFailure

WORKER_CALLS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_stats",
    "clear_connector_metadata",
)
"""The worker-side connector calls a step makes (the ones a worker fault may name)."""
CLEAR = "clear_connector_metadata"


@attrs.frozen
class Client:
    """One request: its prompt, how long it waits to arrive, and whether it aborts."""

    prompt: tuple[int, ...]
    max_tokens: int
    arrive_after: int  # engine steps
    abort: str | None  # None | "client" (stops reading mid-stream) | "engine" (engine.abort)
    abort_after: int  # outputs received first


@attrs.define
class Seen:
    """What one client saw."""

    client: Client
    request_id: str = ""
    outputs: list[RequestOutput] = attrs.field(factory=list)
    aborted: bool = False  # the client aborted (either way) before the request ended


def holds_at_most(runner: Any, req_id: str) -> bool:
    """Whether a worker's runner holds no request state but ``req_id``'s."""
    if runner.num_requests != 1:
        return bool(runner.num_requests == 0)
    try:
        runner.block_table(req_id)
    except KeyError:
        return False
    return True


async def until_idle(engine: AsyncEngine, timeout_s: float = 15.0) -> None:
    """Wait (at most ``timeout_s``) until no step is running and none is needed."""

    def idle() -> bool:
        guards = [w.connector.last_call for w in engine.core.workers]  # type: ignore[union-attr]
        return engine.is_idle and all(g in (None, "register_kv_caches", CLEAR) for g in guards)

    with anyio.fail_after(timeout_s):
        while not idle():
            await anyio.sleep(0.005)
        await anyio.sleep(0.01)
        while not idle():
            await anyio.sleep(0.005)


def check_request(seen: Seen, reference: tuple[int, ...] | None) -> None:
    """Ended exactly once, with tokens or a typed error; tokens are the reference's."""
    outs = seen.outputs
    tokens: tuple[int, ...] = ()
    for out in outs:
        assert out.token_ids == tokens + out.new_token_ids, out
        tokens = out.token_ids
    finals = [o for o in outs if o.finished]
    assert len(finals) <= 1, outs
    if reference is not None:
        assert tokens == reference[: len(tokens)], (tokens, reference)
    if seen.client.abort == "client" and seen.aborted and not finals:
        return  # the client left; the end check proves the request is gone
    assert finals and finals[0] is outs[-1], outs
    final = finals[0]
    reason = final.finish_reason
    if reason in ("length", "stop"):
        assert final.token_ids and len(final.token_ids) <= seen.client.max_tokens
        assert reason == "stop" or len(final.token_ids) == seen.client.max_tokens
        if reference is not None:
            assert final.token_ids == reference
    elif reason == "abort":
        assert seen.aborted, final
    else:
        assert reason == "error", final
        if final.failure is not None:
            assert isinstance(final.failure, StepFailure)
            assert final.failure.ranks or final.failure.failed_stages, final.failure
        else:  # not a failed step: a block that failed to load under the "fail" policy,
            # or a scheduler-side connector call about this request that raised
            assert final.error is not None, final
            assert "failed to load" in final.error or final.error.startswith("connector "), final


def check_clears(calls: Iterable[ConnectorCall]) -> None:
    """Every step of every rank in ``calls`` (worker calls) cleared exactly once, last."""
    by_step: dict[tuple[int, int | None], list[str]] = {}
    for call in calls:
        if call.role == "worker":
            by_step.setdefault((call.rank, call.step_id), []).append(call.method)
    for key, methods in by_step.items():
        if key[1] is not None and methods != ["register_kv_caches"] and methods != ["aclose"]:
            assert methods.count(CLEAR) == 1 and methods[-1] == CLEAR, (key, methods)
