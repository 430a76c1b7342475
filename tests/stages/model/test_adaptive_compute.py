"""``ComputeThread(inline_below_s=...)``: a call whose cost key's recent calls were short
runs on the awaiting thread; the first call of a key, a call without a key, and a key
that grew slow go to the compute thread.

Durations are real (``time.sleep`` inside the call); bounds are wide apart from them
(a call of 0 s against a bound of 0.5 s, a call of 0.2 s against a bound of 0.05 s),
so a loaded machine does not move a call to the other side.
"""

from __future__ import annotations

import contextvars
import threading
import time

import anyio
import pytest

from stages.model.compute_thread import MAX_COST_KEYS, ComputeThread, make_compute

pytestmark = pytest.mark.anyio

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def _where(sleep_s: float = 0.0) -> int:
    """The ident of the thread the call ran on, after sleeping ``sleep_s``."""
    time.sleep(sleep_s)
    return threading.get_ident()


async def test_a_short_key_runs_inline_from_its_second_call() -> None:
    """The first call of a key runs on the thread (nothing is known); once it was short,
    the next calls of that key run on the awaiting thread, counted as inline."""
    compute = ComputeThread("test-adaptive", inline_below_s=0.5)
    try:
        here = threading.get_ident()
        seen = [await compute.run(_where, cost_key="decode") for _ in range(4)]
        estimate = compute.estimate_s("decode")
    finally:
        compute.close()
    assert seen[0] != here and seen[1:] == [here] * 3
    assert (compute.thread_calls, compute.inline_calls) == (1, 3)
    assert estimate is not None and 0 <= estimate < 0.5


async def test_without_a_key_or_with_a_zero_bound_every_call_is_handed_over() -> None:
    """No cost key: the thread, however short the call. A zero bound: the thread, for
    every key (the default of a bare ComputeThread)."""
    here = threading.get_ident()
    keyless = ComputeThread("test-adaptive-keyless", inline_below_s=0.5)
    zero = ComputeThread("test-adaptive-zero")
    try:
        seen = [await keyless.run(_where) for _ in range(3)]
        seen += [await zero.run(_where, cost_key="decode") for _ in range(3)]
    finally:
        keyless.close()
        zero.close()
    assert here not in seen
    assert keyless.inline_calls == zero.inline_calls == 0


async def test_a_long_key_stays_on_the_thread() -> None:
    """Calls longer than the bound are always handed over; their estimate says so."""
    compute = ComputeThread("test-adaptive-long", inline_below_s=0.05)
    try:
        here = threading.get_ident()
        seen = [await compute.run(_where, 0.2, cost_key="prefill") for _ in range(3)]
        estimate = compute.estimate_s("prefill")
    finally:
        compute.close()
    assert here not in seen and compute.inline_calls == 0
    assert estimate is not None and estimate >= 0.2


async def test_keys_are_estimated_apart() -> None:
    """A long key's calls do not make a short key's calls go to the thread."""
    compute = ComputeThread("test-adaptive-keys", inline_below_s=0.05)
    try:
        here = threading.get_ident()
        order = ["short", "long", "short", "long", "short"]
        seen = [
            await compute.run(_where, 0.2 if key == "long" else 0.0, cost_key=key) for key in order
        ]
    finally:
        compute.close()
    assert [s == here for s in seen] == [False, False, True, False, True]


async def test_a_key_that_grew_slow_goes_back_to_the_thread() -> None:
    """An inline call that took far longer than the bound raises its key's estimate past
    it: the next call of that key is handed over again."""
    compute = ComputeThread("test-adaptive-slow", inline_below_s=0.05)
    try:
        here = threading.get_ident()
        seen = [await compute.run(_where, 0.0, cost_key="k")]  # thread: unknown
        seen.append(await compute.run(_where, 0.0, cost_key="k"))  # inline: short
        seen.append(await compute.run(_where, 0.5, cost_key="k"))  # inline, then slow
        seen.append(await compute.run(_where, 0.0, cost_key="k"))  # back on the thread
    finally:
        compute.close()
    assert [s == here for s in seen] == [False, True, True, False]


async def test_an_inline_call_that_raises_raises_here_and_counts() -> None:
    """An exception of an inline call reaches the awaiting caller unchanged, and the
    failed call's duration still enters its key's estimate."""
    compute = ComputeThread("test-adaptive-raise", inline_below_s=0.05)

    def fail(sleep_s: float) -> None:
        time.sleep(sleep_s)
        raise ValueError("injected failure")

    try:
        await compute.run(_where, cost_key="k")
        with pytest.raises(ValueError, match="injected failure"):
            await compute.run(fail, 0.5, cost_key="k")
        estimate = compute.estimate_s("k")
        where = await compute.run(_where, cost_key="k")
    finally:
        compute.close()
    assert compute.inline_calls == 1
    assert estimate is not None and estimate > 0.05
    assert where != threading.get_ident()


async def test_an_inline_call_sees_a_copy_of_the_callers_context() -> None:
    """Inline, as on the thread: the caller's context variables are visible, and what
    the call binds stays in its own copy."""
    compute = ComputeThread("test-adaptive-context", inline_below_s=0.5)

    def call() -> tuple[int, str]:
        seen = VAR.get()
        VAR.set("set inside")
        return threading.get_ident(), seen

    VAR.set("bound")
    try:
        on_thread = await compute.run(call, cost_key="k")
        inline = await compute.run(call, cost_key="k")
    finally:
        compute.close()
    assert on_thread[1] == inline[1] == "bound"
    assert inline[0] == threading.get_ident() != on_thread[0]
    assert VAR.get() == "bound"


async def test_a_cancelled_caller_does_not_start_an_inline_call() -> None:
    """Awaited in a cancelled scope, a call that would run inline is not made."""
    compute = ComputeThread("test-adaptive-cancel", inline_below_s=0.5)
    calls: list[int] = []
    try:
        await compute.run(calls.append, 1, cost_key="k")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await compute.run(calls.append, 2, cost_key="k")
    finally:
        compute.close()
    assert scope.cancelled_caught and calls == [1]


async def test_estimates_are_capped_least_recently_used_first() -> None:
    """At most MAX_COST_KEYS estimates are kept; the key unused longest goes first."""
    compute = ComputeThread("test-adaptive-cap", inline_below_s=0.5)
    try:
        for key in range(MAX_COST_KEYS):
            await compute.run(int, cost_key=key)
        await compute.run(int, cost_key=0)  # 0 is used again: 1 is now the oldest
        await compute.run(int, cost_key="new")
    finally:
        compute.close()
    assert compute.estimate_s(0) is not None and compute.estimate_s("new") is not None
    assert compute.estimate_s(1) is None
    assert compute.estimate_s(MAX_COST_KEYS - 1) is not None


def test_make_compute_passes_the_bound() -> None:
    compute = make_compute("test-adaptive-make", inline_below_s=0.25)
    assert isinstance(compute, ComputeThread) and compute.inline_below_s == 0.25
    compute.close()


async def test_a_short_call_waits_behind_a_pending_handed_over_call() -> None:
    """While a call runs on the thread, a call that would run inline is handed over too,
    and runs after it: calls never overlap, in submission order."""
    compute = ComputeThread("test-adaptive-order", inline_below_s=0.5)
    order: list[str] = []

    def record(label: str, sleep_s: float) -> int:
        order.append(f"{label} start")
        time.sleep(sleep_s)
        order.append(f"{label} end")
        return threading.get_ident()

    try:
        await compute.run(record, "warm", 0.0, cost_key="short")
        order.clear()
        where: dict[str, int] = {}

        async def call(label: str, sleep_s: float, key: str | None) -> None:
            where[label] = await compute.run(record, label, sleep_s, cost_key=key)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "long", 0.2, None)
            await anyio.sleep(0.05)  # the long call is on the thread
            tg.start_soon(call, "short", 0.0, "short")
        here = threading.get_ident()
        after = await compute.run(_where, cost_key="short")  # nothing pending: inline
    finally:
        compute.close()
    assert order == ["long start", "long end", "short start", "short end"]
    assert where["long"] == where["short"] != here
    assert after == here
