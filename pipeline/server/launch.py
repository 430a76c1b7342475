"""``serve``: run the app under uvicorn (the ``kvstep serve`` command), and its CLI."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError
from pipeline.logger import cli_logging, get_logger
from pipeline.server.app import create_app
from pipeline.server.lora import parse_lora_module
from pipeline.server.options import API_KEY_ENV, ServerOptions
from pipeline.server.reasoning import REASONING_PARSERS
from pipeline.server.tool_parsers import TOOL_PARSERS

__all__ = ["add_server_flags", "main", "serve", "server_options"]

_log = get_logger()


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    options: ServerOptions | None = None,
    *,
    access_log: bool = False,
) -> None:
    """Serve an engine built from ``config`` on ``host:port`` until interrupted.

    Blocks the calling thread (uvicorn owns the event loop). SIGINT/SIGTERM drain the
    server (:mod:`pipeline.server.draining`): new requests get 503 with ``Retry-After``
    and ``/health`` 503 ``draining`` while the requests in flight finish, for at most
    ``options.shutdown_timeout_s``; what is left then ends with ``finish_reason:
    "abort"``, the engine closes (releasing held KV, flushing the step log) and
    ``serve`` returns. A second signal aborts what is in flight at once.
    ``options`` sets the body cap and timeout, the API key, the header and keep-alive
    timeouts and uvicorn's ``limit_concurrency`` (defaults: :class:`ServerOptions`).
    ``access_log`` turns on uvicorn's access log (one line per request, on stdout).
    Once listening it logs ``listening on http://HOST:PORT`` (info, ``kvstep`` logger),
    and ``shutdown complete`` after a graceful stop.

    Raises:
        SystemExit: The server did not start (e.g. the port is in use; uvicorn logs why).
    """

    from pipeline.server.protocol import run_uvicorn

    options = options or ServerOptions()
    app = create_app(config, freeze_gc=True, options=options)
    drain = app.state.kvstep.drain
    run_uvicorn(app, host, port, options, access_log, _server_class(), drain)


def _server_class() -> type:
    from pipeline.server.draining import DrainingServer

    class Server(DrainingServer):
        """The draining server, logging the ready and shutdown lines.

        The shutdown line is logged here, not after ``run()``: after uvicorn's force
        quit (a third signal) it re-raises the signal, which ends the process.
        """

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                _log.info(f"listening on {_url(self)}")

        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets=sockets)
            _log.info("shutdown complete")

    return Server


def _url(server: Any) -> str:
    host, port = server.config.host, server.config.port
    for listener in getattr(server, "servers", []):  # the bound port (also for --port 0)
        for sock in listener.sockets:
            port = sock.getsockname()[1]
            break
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """The :class:`ServerOptions` flags (``--api-key``, ``--max-body-bytes``, ...)."""
    defaults = ServerOptions()
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${API_KEY_ENV}; prefer the variable, argv is visible to other users)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=defaults.max_body_bytes, help="413 past it"
    )
    parser.add_argument(
        "--body-timeout", type=float, default=defaults.body_timeout_s, help="seconds; 408"
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout_s,
        help="seconds a connection may take to send a request's headers",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=defaults.timeout_keep_alive_s,
        help="seconds an idle keep-alive connection stays open",
    )
    parser.add_argument(
        "--limit-concurrency",
        type=int,
        default=defaults.limit_concurrency,
        help="connections + requests at once; 503 past it (0: no limit)",
    )
    parser.add_argument(
        "--max-request-share",
        type=float,
        default=defaults.max_request_share,
        help="share of --max-num-seqs one request's choices (n x prompts) may take; 400 past it",
    )
    parser.add_argument(
        "--max-prompt-logprobs",
        type=int,
        default=defaults.max_prompt_logprobs,
        help="most prompt logprob values per request (prompt tokens x (prompt_logprobs + 1), "
        "over its choices); 400 past it",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the model's tool-call format: chat's tool_choice 'auto' reads calls with it "
        "(hermes: Qwen 2.5/3, Hermes; llama3_json: Llama 3.x); default: none, 'auto' is a 400",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag, accepted: with --tool-call-parser, 'auto' is on anyway",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="the model's reasoning format: chat answers carry the thinking as "
        "reasoning_content; default: none",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=None,
        help="LoRA adapters (peft directories) to serve, each as a model of its NAME "
        '(vLLM\'s name=path or {"name": ..., "path": ...}); turns on --enable-lora',
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout_s,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds the requests in flight may take to finish while "
        "new ones get 503 and /health says draining; then the rest are aborted "
        "(0: abort at once; a second signal: at once)",
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (uvicorn's access log, on stdout; default: off)",
    )


def server_options(args: argparse.Namespace) -> ServerOptions:
    """:class:`ServerOptions` from the flags of :func:`add_server_flags`."""
    fields: dict[str, Any] = {
        "api_key": args.api_key,
        "max_body_bytes": args.max_body_bytes,
        "body_timeout_s": args.body_timeout,
        "header_timeout_s": args.header_timeout,
        "timeout_keep_alive_s": args.timeout_keep_alive,
        "limit_concurrency": args.limit_concurrency or None,
        "max_request_share": args.max_request_share,
        "max_prompt_logprobs": args.max_prompt_logprobs,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "lora_modules": tuple(parse_lora_module(m) for m in args.lora_modules or ()),
        "shutdown_timeout_s": args.shutdown_timeout,
    }
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidConfigError(
            "--enable-auto-tool-choice", True, "needs --tool-call-parser (as vLLM)"
        )
    return ServerOptions.from_env(**fields)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m pipeline.server --model M --port P``."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-queue-depth", type=int, default=None)
    parser.add_argument("--executor", default=None)
    parser.add_argument("--world-size", type=int, default=None)
    add_server_flags(parser)
    args = parser.parse_args(argv)
    fields: dict[str, object] = {"model": args.model, "dtype": args.dtype}
    for name in ("max_model_len", "max_queue_depth", "executor", "world_size"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    with cli_logging(logging.INFO):
        serve(
            EngineConfig(**fields),  # type: ignore[arg-type]
            args.host,
            args.port,
            server_options(args),
            access_log=args.access_log,
        )
