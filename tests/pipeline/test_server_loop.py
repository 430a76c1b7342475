"""``kvstep serve`` runs on asyncio's event loop even where uvloop imports (uvicorn's own
default would take uvloop; it measured slower: ``pipeline.server.protocol.SERVER_LOOP``)."""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import pytest

pytest.importorskip("uvicorn")

from pipeline.server.options import ServerOptions
from pipeline.server.protocol import run_uvicorn


def test_uvloop_importable_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``uvloop`` module importable: the loop factory the server runs with is still
    asyncio's (uvicorn's ``"auto"`` would return uvloop's ``new_event_loop``)."""
    fake = types.ModuleType("uvloop")
    fake.new_event_loop = lambda: pytest.fail("uvloop's loop was built")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvloop", fake)
    seen: dict[str, Any] = {}

    class RecordingServer:
        """Stands in for DrainingServer: records the loop factory instead of serving."""

        def __init__(self, config: Any, drain: Any = None) -> None:
            self.config = config
            self.started = False

        def run(self) -> None:
            seen["factory"] = self.config.get_loop_factory()
            self.started = True

    run_uvicorn(object(), "127.0.0.1", 0, ServerOptions(), False, RecordingServer)
    assert seen["factory"] is asyncio.SelectorEventLoop
