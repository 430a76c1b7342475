"""``serve``: run the app under uvicorn (the ``kvstep serve`` command), and its CLI."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pipeline.config import EngineConfig
from pipeline.server.app import create_app

__all__ = ["main", "serve"]


def serve(config: EngineConfig, host: str, port: int) -> None:
    """Serve an engine built from ``config`` on ``host:port`` until interrupted.

    Blocks the calling thread (uvicorn owns the event loop); SIGINT/SIGTERM shut the
    server down gracefully, which closes the engine (aborting what is in flight).
    """
    import uvicorn

    app = create_app(config, freeze_gc=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="on")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m pipeline.server --model M --port P``."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-queue-depth", type=int, default=None)
    args = parser.parse_args(argv)
    fields: dict[str, object] = {"model": args.model, "dtype": args.dtype}
    if args.max_model_len is not None:
        fields["max_model_len"] = args.max_model_len
    if args.max_queue_depth is not None:
        fields["max_queue_depth"] = args.max_queue_depth
    serve(EngineConfig(**fields), args.host, args.port)  # type: ignore[arg-type]
