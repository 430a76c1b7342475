"""Tests of the lifecycle guard (connectors.lifecycle)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorker,
    WorkerFinished,
)
from connectors.lifecycle import ALLOWED_PREVIOUS, GuardedWorker, make_worker
from pipeline.errors import ConnectorLifecycleError

CTX: Any = None  # the guard never looks at the ForwardContext; the inner worker neither
KV: Any = None  # nor the KV tensor


class _Meta(KVConnectorMetadata):
    pass


class _Inner(KVConnectorWorker):
    """Logs the name of every call it receives; can be told to fail one method."""

    def __init__(self) -> None:
        super().__init__(ConnectorContext(role=KVConnectorRole.WORKER, rank=3))
        self.log: list[str] = []
        self.fail: str | None = None

    def _hit(self, name: str) -> None:
        self.log.append(name)
        if self.fail == name:
            raise OSError(f"{name} failed")

    def register_kv_caches(self, kv_caches: Sequence[Any]) -> None:
        self._hit("register_kv_caches")

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._hit("bind_connector_metadata")
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._hit("clear_connector_metadata")
        super().clear_connector_metadata()

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        self._hit("start_load_kv")

    def wait_for_layer_load(self, layer: int) -> None:
        self._hit(f"wait_for_layer_load:{layer}")

    def save_kv_layer(self, layer: int, kv_layer: Any, ctx: ForwardContext) -> None:
        self._hit(f"save_kv_layer:{layer}")

    async def wait_for_save(self) -> frozenset[str]:
        self._hit("wait_for_save")
        return frozenset({"failed-save"})

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        self._hit("get_finished")
        return WorkerFinished(sending=finished_req_ids)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        self._hit("get_block_ids_with_load_errors")
        return frozenset({7})

    def get_kv_stats(self) -> tuple[int, int, int, int]:
        self._hit("get_kv_stats")
        return (1, 2, 3, 4)

    async def aclose(self) -> None:
        self._hit("aclose")


# Each step-level call by name, as a zero-argument function running it on the guard.
def _call(guard: GuardedWorker, name: str) -> Callable[[], object]:
    calls: dict[str, Callable[[], object]] = {
        "register_kv_caches": lambda: guard.register_kv_caches([]),
        "begin_step": lambda: guard.begin_step(99),
        "bind_connector_metadata": lambda: guard.bind_connector_metadata(_Meta()),
        "start_load_kv": lambda: anyio.run(guard.start_load_kv, CTX),
        "wait_for_layer_load": lambda: guard.wait_for_layer_load(0),
        "save_kv_layer": lambda: guard.save_kv_layer(0, KV, CTX),
        "wait_for_save": lambda: anyio.run(guard.wait_for_save),
        "get_finished": lambda: anyio.run(guard.get_finished, frozenset()),
        "get_block_ids_with_load_errors": guard.get_block_ids_with_load_errors,
        "get_kv_stats": guard.get_kv_stats,
        "clear_connector_metadata": guard.clear_connector_metadata,
        "aclose": lambda: anyio.run(guard.aclose),
    }
    return calls[name]


STEP = [
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
]
ALL_CALLS = ["begin_step", *STEP, "get_block_ids_with_load_errors", "get_kv_stats"]


def _guard_after(prefix: Sequence[str], step_id: int = 5) -> tuple[GuardedWorker, _Inner]:
    inner = _Inner()
    guard = GuardedWorker(inner)
    guard.begin_step(step_id)
    for name in prefix:
        _call(guard, name)()
    return guard, inner


class TestGuardedWorkerHappyPath:
    def test_full_step_forwards_every_call_in_order(self) -> None:
        """A step with several layers forwards each call and returns the inner results."""
        inner = _Inner()
        guard = GuardedWorker(inner)
        guard.register_kv_caches([])
        guard.begin_step(0)
        meta = _Meta()
        guard.bind_connector_metadata(meta)
        assert guard.connector_metadata is meta

        async def step() -> tuple[frozenset[str], WorkerFinished]:
            await guard.start_load_kv(CTX)
            for layer in range(3):
                guard.wait_for_layer_load(layer)
                guard.save_kv_layer(layer, KV, CTX)
            failed = await guard.wait_for_save()
            return failed, await guard.get_finished(frozenset({"r1"}))

        failed, finished = anyio.run(step)
        assert failed == frozenset({"failed-save"})
        assert finished == WorkerFinished(sending=frozenset({"r1"}))
        assert guard.get_block_ids_with_load_errors() == frozenset({7})
        assert guard.get_kv_stats() == (1, 2, 3, 4)
        guard.clear_connector_metadata()
        assert guard.connector_metadata is None
        layers = [f"{h}:{i}" for i in range(3) for h in ("wait_for_layer_load", "save_kv_layer")]
        assert inner.log == [
            "register_kv_caches",
            "bind_connector_metadata",
            "start_load_kv",
            *layers,
            "wait_for_save",
            "get_finished",
            "get_block_ids_with_load_errors",
            "get_kv_stats",
            "clear_connector_metadata",
        ]

    def test_zero_layers_is_a_valid_step(self) -> None:
        """wait_for_save may directly follow start_load_kv (a model without hooks)."""
        guard, _ = _guard_after(["bind_connector_metadata", "start_load_kv", "wait_for_save"])
        _call(guard, "get_finished")()
        guard.clear_connector_metadata()
        assert guard.last_call == "clear_connector_metadata"

    def test_steps_follow_each_other_after_clear(self) -> None:
        """begin_step is allowed again after the previous step's clear; step_id follows."""
        guard, _ = _guard_after(STEP, step_id=1)
        guard.clear_connector_metadata()
        assert guard.step_id == 1
        guard.begin_step(2)
        assert guard.step_id == 2
        assert guard.last_call == "begin_step"

    @pytest.mark.parametrize("n", range(len(STEP) + 1))
    def test_clear_allowed_after_any_in_step_call(self, n: int) -> None:
        """A step that stops after any call (even right after begin_step) may clear."""
        guard, inner = _guard_after(STEP[:n])
        guard.clear_connector_metadata()
        assert inner.log[-1] == "clear_connector_metadata"
        guard.begin_step(6)

    def test_queries_do_not_change_state(self) -> None:
        """The two queries are allowed after start_load_kv and leave last_call alone."""
        guard, _ = _guard_after(STEP[:2])
        guard.get_block_ids_with_load_errors()
        guard.get_kv_stats()
        assert guard.last_call == "start_load_kv"
        _call(guard, "wait_for_layer_load")()

    def test_clear_allowed_after_a_failing_inner_call(self) -> None:
        """A call that raised inside the connector still counts, so the clear is allowed."""
        guard, inner = _guard_after(["bind_connector_metadata"])
        inner.fail = "start_load_kv"
        with pytest.raises(OSError, match="start_load_kv failed"):
            _call(guard, "start_load_kv")()
        guard.clear_connector_metadata()
        assert guard.connector_metadata is None

    def test_layer_hooks_on_a_worker_thread(self) -> None:
        """The per-layer hooks may run on a forward thread between the async calls."""
        guard, inner = _guard_after(STEP[:2])

        def forward() -> None:
            for layer in range(4):
                guard.wait_for_layer_load(layer)
                guard.save_kv_layer(layer, KV, CTX)

        async def rest() -> None:
            await anyio.to_thread.run_sync(forward)
            await guard.wait_for_save()

        anyio.run(rest)
        assert inner.log[-1] == "wait_for_save"
        assert "save_kv_layer:3" in inner.log

    def test_clear_racing_a_hook_thread_is_never_overwritten(self) -> None:
        """A clear that lands while a thread runs layer hooks leaves the guard cleared."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as possible
        try:
            for _ in range(200):
                guard, _ = _guard_after(STEP[:2])
                started = threading.Event()
                refused: list[ConnectorLifecycleError] = []
                args = (guard, started, refused)
                thread = threading.Thread(target=_hooks_until_refused, args=args)
                thread.start()
                started.wait(5)
                guard.clear_connector_metadata()
                thread.join(5)
                assert refused and refused[0].previous == "clear_connector_metadata"
                assert guard.last_call == "clear_connector_metadata"
                guard.begin_step(6)
        finally:
            sys.setswitchinterval(interval)


def _hooks_until_refused(
    guard: GuardedWorker, started: threading.Event, refused: list[ConnectorLifecycleError]
) -> None:
    try:
        for layer in range(10_000_000):
            guard.wait_for_layer_load(layer)
            started.set()
    except ConnectorLifecycleError as exc:
        refused.append(exc)


class TestGuardedWorkerRefusals:
    @pytest.mark.parametrize(
        ("prefix", "call", "previous"),
        [
            ([], "start_load_kv", "begin_step"),
            ([], "wait_for_layer_load", "begin_step"),
            ([], "save_kv_layer", "begin_step"),
            ([], "wait_for_save", "begin_step"),
            ([], "get_finished", "begin_step"),
            ([], "get_kv_stats", "begin_step"),
            ([], "begin_step", "begin_step"),
            (STEP[:1], "bind_connector_metadata", "bind_connector_metadata"),
            (STEP[:1], "wait_for_layer_load", "bind_connector_metadata"),
            (STEP[:1], "wait_for_save", "bind_connector_metadata"),
            (STEP[:1], "get_block_ids_with_load_errors", "bind_connector_metadata"),
            (STEP[:2], "start_load_kv", "start_load_kv"),
            (STEP[:2], "get_finished", "start_load_kv"),
            (STEP[:4], "bind_connector_metadata", "save_kv_layer"),
            (STEP[:4], "get_finished", "save_kv_layer"),
            (STEP[:5], "wait_for_layer_load", "wait_for_save"),
            (STEP[:5], "save_kv_layer", "wait_for_save"),
            (STEP[:5], "wait_for_save", "wait_for_save"),
            (STEP, "get_finished", "get_finished"),
            (STEP, "wait_for_save", "get_finished"),
            (STEP, "register_kv_caches", "get_finished"),
            (STEP, "aclose", "get_finished"),
        ],
    )
    def test_out_of_order_call_is_refused(
        self, prefix: list[str], call: str, previous: str
    ) -> None:
        """An out-of-order call raises, naming step, call and previous; changes nothing."""
        guard, inner = _guard_after(prefix, step_id=41)
        before = list(inner.log)
        with pytest.raises(ConnectorLifecycleError) as info:
            _call(guard, call)()
        err = info.value
        assert (err.step_id, err.call, err.previous) == (41, call, previous)
        assert err.allowed == tuple(sorted(ALLOWED_PREVIOUS[call]))
        assert f"step 41: connector call {call!r} after {previous!r}" in str(err)
        assert isinstance(err, RuntimeError)
        assert inner.log == before
        assert guard.last_call == (prefix[-1] if prefix else "begin_step")

    def test_begin_step_refused_when_previous_step_never_cleared(self) -> None:
        """A step that never cleared blocks the next one: stale metadata cannot leak."""
        guard, _ = _guard_after(STEP, step_id=8)
        with pytest.raises(ConnectorLifecycleError) as info:
            guard.begin_step(9)
        assert (info.value.step_id, info.value.call) == (8, "begin_step")
        assert info.value.previous == "get_finished"
        assert guard.step_id == 8
        assert guard.connector_metadata is not None

    @pytest.mark.parametrize("call", [*ALL_CALLS[1:], "clear_connector_metadata"])
    def test_any_step_call_after_clear_is_refused(self, call: str) -> None:
        """After clear only the next begin_step (or aclose) is allowed."""
        guard, inner = _guard_after(STEP)
        guard.clear_connector_metadata()
        with pytest.raises(ConnectorLifecycleError) as info:
            _call(guard, call)()
        assert info.value.previous == "clear_connector_metadata"
        assert inner.log.count("clear_connector_metadata") == 1

    def test_double_clear_is_refused(self) -> None:
        """A second clear in the same step raises and is not forwarded."""
        guard, inner = _guard_after([])
        guard.clear_connector_metadata()
        with pytest.raises(ConnectorLifecycleError, match="'clear_connector_metadata' after"):
            guard.clear_connector_metadata()
        assert inner.log == ["clear_connector_metadata"]

    @pytest.mark.parametrize("call", [c for c in ALL_CALLS if c != "begin_step"])
    def test_step_calls_before_the_first_step_are_refused(self, call: str) -> None:
        """Before the first begin_step no step call is allowed; step_id is None."""
        guard = GuardedWorker(_Inner())
        with pytest.raises(ConnectorLifecycleError) as info:
            _call(guard, call)()
        assert (info.value.step_id, info.value.previous) == (None, "(none)")
        assert guard.last_call is None

    def test_clear_before_any_step_is_refused(self) -> None:
        """clear with no step open raises."""
        with pytest.raises(ConnectorLifecycleError):
            GuardedWorker(_Inner()).clear_connector_metadata()

    def test_register_kv_caches_only_once_before_the_first_step(self) -> None:
        """register_kv_caches is allowed once, before the first begin_step."""
        guard = GuardedWorker(_Inner())
        guard.register_kv_caches([])
        with pytest.raises(ConnectorLifecycleError):
            guard.register_kv_caches([])
        guard.begin_step(0)
        guard.clear_connector_metadata()
        with pytest.raises(ConnectorLifecycleError, match="'register_kv_caches'"):
            guard.register_kv_caches([])


class TestGuardedWorkerClose:
    def test_aclose_before_the_first_step(self) -> None:
        """aclose before any step is forwarded once; a second call is a no-op."""
        inner = _Inner()
        guard = GuardedWorker(inner)
        anyio.run(guard.aclose)
        anyio.run(guard.aclose)
        assert inner.log == ["aclose"]
        assert guard.last_call == "aclose"

    def test_aclose_after_clear(self) -> None:
        """aclose after a step's clear is forwarded."""
        guard, inner = _guard_after(STEP)
        guard.clear_connector_metadata()
        anyio.run(guard.aclose)
        assert inner.log[-2:] == ["clear_connector_metadata", "aclose"]

    def test_aclose_inside_a_step_is_refused(self) -> None:
        """aclose between begin_step and clear raises and does not close the connector."""
        guard, inner = _guard_after(STEP[:2])
        with pytest.raises(ConnectorLifecycleError, match="'aclose' after 'start_load_kv'"):
            anyio.run(guard.aclose)
        assert "aclose" not in inner.log

    def test_calls_after_aclose_are_refused(self) -> None:
        """Nothing, not even begin_step, follows aclose."""
        guard = GuardedWorker(_Inner())
        anyio.run(guard.aclose)
        with pytest.raises(ConnectorLifecycleError, match="after 'aclose'"):
            guard.begin_step(0)

    def test_failing_aclose_is_not_retried(self) -> None:
        """The guard counts as closed even if the inner aclose raises."""
        inner = _Inner()
        inner.fail = "aclose"
        guard = GuardedWorker(inner)
        with pytest.raises(OSError):
            anyio.run(guard.aclose)
        anyio.run(guard.aclose)
        assert inner.log == ["aclose"]


class TestMakeWorker:
    def test_enabled_wraps_in_the_guard(self) -> None:
        """make_worker guards by default and shares the connector's context."""
        inner = _Inner()
        guard = make_worker(inner)
        assert isinstance(guard, GuardedWorker)
        assert guard.inner is inner
        assert guard.context is inner.context

    def test_disabled_returns_the_raw_worker(self) -> None:
        """With enabled=False the worker comes back unwrapped and unchecked."""
        inner = _Inner()
        worker = make_worker(inner, enabled=False)
        assert worker is inner
        worker.clear_connector_metadata()  # out of order, but unchecked

    def test_never_guards_twice(self) -> None:
        """A guarded worker is returned as is."""
        guard = make_worker(_Inner())
        assert make_worker(guard) is guard


class TestAllowedPrevious:
    def test_table_matches_the_documented_order(self) -> None:
        """The public table states the per-step order of the design."""
        assert ALLOWED_PREVIOUS["bind_connector_metadata"] == {"begin_step"}
        assert ALLOWED_PREVIOUS["start_load_kv"] == {"bind_connector_metadata"}
        hooks = {"start_load_kv", "wait_for_layer_load", "save_kv_layer"}
        assert ALLOWED_PREVIOUS["wait_for_layer_load"] == hooks
        assert ALLOWED_PREVIOUS["wait_for_save"] == hooks
        assert ALLOWED_PREVIOUS["get_finished"] == {"wait_for_save"}
        assert "clear_connector_metadata" not in ALLOWED_PREVIOUS["clear_connector_metadata"]
        assert ALLOWED_PREVIOUS["begin_step"] == {
            "(none)",
            "register_kv_caches",
            "clear_connector_metadata",
        }
