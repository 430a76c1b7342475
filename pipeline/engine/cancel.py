"""Consuming a native asyncio ``task.cancel()`` that the engine turned into a step failure."""

from __future__ import annotations

__all__ = ["consume_native_cancel"]


def consume_native_cancel() -> None:
    """Consume a native ``task.cancel()`` of the current task (asyncio): the engine
    turned it into a step failure, so the task must not stay cancelled. No-op under
    trio (no native cancel) or when the task is not being cancelled."""
    try:
        import asyncio

        task = asyncio.current_task()
    except RuntimeError:  # not running under asyncio
        return
    if task is not None and task.cancelling():
        task.uncancel()
