"""The engine fronts: :class:`EngineCore` (one step at a time), :class:`AsyncEngine`
(the step loop and per-request streams) and :class:`LLM` (blocking, batch generation)."""

from __future__ import annotations

from pipeline.engine.async_engine import AsyncEngine, RequestStream
from pipeline.engine.core import EngineCore
from pipeline.engine.llm import LLM

__all__ = ["LLM", "AsyncEngine", "EngineCore", "RequestStream"]
