"""An OpenAI-compatible HTTP server over :class:`~pipeline.AsyncEngine` (extra ``server``).

``create_app(engine_or_config)`` returns a Starlette app to embed; ``serve(config, host,
port)`` runs it under uvicorn (``kvstep serve``).
"""

from pipeline.server.app import ServerState, create_app
from pipeline.server.drain import Drain, DrainResult
from pipeline.server.launch import add_server_flags, main, serve, server_options
from pipeline.server.metrics import LoopLagMonitor, ServerMetrics
from pipeline.server.options import ServerOptions

__all__ = [
    "Drain",
    "DrainResult",
    "LoopLagMonitor",
    "ServerMetrics",
    "ServerOptions",
    "ServerState",
    "add_server_flags",
    "create_app",
    "main",
    "serve",
    "server_options",
]
