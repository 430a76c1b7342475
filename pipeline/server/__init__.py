"""An OpenAI-compatible HTTP server over :class:`~pipeline.AsyncEngine` (extra ``server``).

``create_app(engine_or_config)`` returns a Starlette app to embed; ``serve(config, host,
port)`` runs it under uvicorn (``kvstep serve``).
"""

from pipeline.server.app import ServerState, create_app
from pipeline.server.launch import main, serve
from pipeline.server.metrics import LoopLagMonitor, ServerMetrics

__all__ = ["LoopLagMonitor", "ServerMetrics", "ServerState", "create_app", "main", "serve"]
